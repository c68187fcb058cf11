"""rollout.layout='auto' (jaxflow/config/machine.py `resolve_layout`): resolved once, before the validated config is
used, to the first layout that fits the card (the recipe's vLLM-Omni colocated on an H200, the diffusers engine in the
trainer's process on its weights on an 80 GB card); a pinned layout is never changed, a resume keeps its run's."""
import json
import sys
from pathlib import Path

import pytest

from jaxflow import plan as plan_cli
from jaxflow.config import machine, planner, recipes, validation
from jaxflow.run import run_dir
from jaxflow_bench import phase_costs
from tests.helpers import fake_run, tiny_config

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
H200, H100 = planner.Card("NVIDIA H200", 140.4), planner.Card("NVIDIA H100 80GB HBM3", 79.65)
RECIPE = planner.ModelSizes(**phase_costs.RECIPE, lora_params=phase_costs.memory_row(
    json.loads((RESULTS / phase_costs.MEMORY_FILE).read_text()))[1])


@pytest.fixture
def on_card(monkeypatch):
    """The recipe's full-size sizes (the tiny folder stands in for its files) on one faked card."""
    monkeypatch.setattr(machine, "model_sizes", lambda cfg, folder: RECIPE)

    def use(card, gpus=1):
        monkeypatch.setattr(machine, "local_gpus", lambda: (card, gpus))
    return use


def _recipe(tmp_path, **rollout):
    cfg = recipes.base()
    cfg.model.path, cfg.run_dir = "tiny", str(tmp_path / "run")
    cfg.rollout.update(rollout)
    return cfg


def _rollout(cfg):
    return cfg.rollout.layout, cfg.rollout.engine, cfg.rollout.share_weights, cfg.train.num_micro_batches


def test_the_recipe_on_an_80_gb_card_runs_the_diffusers_engine_in_process_on_shared_weights(tmp_path, on_card):
    on_card(H100)
    assert recipes.base().rollout.layout == "auto"  # configs/qwen_ocr.py
    resolved, line = machine.resolve_layout(validation.validate(_recipe(tmp_path)))
    assert _rollout(resolved) == ("in_process", "diffusers", True, 256)  # 1 sample per micro-batch of 256
    assert line.startswith("layout auto: in_process, the diffusers engine on the trainer weights (in place of "
                           "rollout.engine='vllm_omni'), rollout.compile=True, train.num_micro_batches=256: the first "
                           "layout that fits 1 x NVIDIA H100")
    assert resolved.rollout.compile  # the diffusers engine as it ran on an 80 GB card (its cost row)
    assert "colocated with the vllm_omni engine does not" in line
    plan = machine.machine_plan(resolved)  # what the resolved config plans: it fits as it is
    assert (plan.layout.name, plan.layout.engine, plan.micro_batch) == ("in_process", "diffusers", 1)
    block = machine.before_jax(resolved, line)
    assert block.splitlines()[0] == line and block.splitlines()[1].startswith("machine: 1 x NVIDIA H100")


def test_the_recipe_on_a_140_gb_card_stays_colocated_with_vllm_omni(tmp_path, on_card):
    on_card(H200)
    resolved, line = machine.resolve_layout(validation.validate(_recipe(tmp_path)))
    assert _rollout(resolved) == ("colocated", "vllm_omni", False, 64)
    assert line == "layout auto: colocated, the vllm_omni engine: the first layout that fits 1 x NVIDIA H200 (140 GiB)"


def test_several_80_gb_cards_keep_the_colocated_layout_and_the_plan_says_none_fits(tmp_path, on_card):
    on_card(H100, 2)
    resolved, line = machine.resolve_layout(validation.validate(_recipe(tmp_path)))
    assert _rollout(resolved)[:3] == ("colocated", "vllm_omni", False) and "none fits 2 x NVIDIA H100" in line


@pytest.mark.parametrize("layout", ["colocated", "split"])
def test_a_pinned_layout_is_never_changed(tmp_path, on_card, layout):
    on_card(H100)
    cfg = validation.validate(_recipe(tmp_path, layout=layout))
    assert machine.resolve_layout(cfg) == (cfg, None)


def test_without_a_card_auto_is_colocated_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(machine, "local_gpus", lambda: None)
    cpu = tiny_config(tmp_path, num_micro_batches=1)
    cpu.rollout.layout = "auto"
    resolved, line = machine.resolve_layout(validation.validate(cpu))
    assert resolved.rollout.layout == "colocated" and line.endswith("no card to plan for (rollout.device='cpu')")
    resolved, line = machine.resolve_layout(validation.validate(_recipe(tmp_path)))
    assert _rollout(resolved)[:2] == ("colocated", "vllm_omni") and "nvidia-smi found no GPU" in line


def test_a_resumed_run_keeps_its_layout_on_another_card(tmp_path, on_card):
    """A run that auto put in_process on an 80 GB card resumes in_process on an H200 (where auto would pick
    colocated), and the resume's config check finds nothing changed."""
    on_card(H100)
    first, _ = machine.resolve_layout(validation.validate(_recipe(tmp_path)))
    fake_run(Path(first.run_dir), first)
    on_card(H200)
    again = validation.validate(_recipe(tmp_path))
    fresh = machine.resolve_layout(again)[0]
    assert _rollout(fresh)[0] == "colocated"  # a new run on this card; resuming with it changes the engine
    with pytest.raises(validation.UserError, match="rollout.engine: 'diffusers' -> 'vllm_omni'"):
        run_dir.check_resume(fresh)
    resumed, line = machine.resolve_layout(again, resume=True)
    assert _rollout(resumed)[:3] == ("in_process", "diffusers", True)
    assert line.endswith("the layout of checkpoint 5, which --resume continues")
    assert run_dir.check_resume(resumed) is None  # refuses a change of the keys that change the training


def test_a_config_the_chosen_layout_refuses_is_one_line_naming_the_choice(tmp_path, on_card):
    on_card(H100)
    cfg = validation.validate(_recipe(tmp_path, quantization="fp8"))
    with pytest.raises(validation.UserError) as info:
        machine.resolve_layout(cfg)
    text = str(info.value)
    assert text.startswith("config.rollout.quantization") and "layout auto: in_process" in text
    assert "pin rollout.layout" in text and "\n" not in text


def test_python_m_jaxflow_plan_shows_the_choice(capsys, monkeypatch, on_card):
    argv = ["plan", "--config", str(ROOT / "configs" / "qwen_ocr.py"), "--config.model.path=tiny", "--gpus", "1",
            "--gpu-memory", "79.65"]
    monkeypatch.setattr(sys, "argv", argv)
    on_card(H100)
    assert plan_cli.main(argv) == 0
    first, second = capsys.readouterr().out.splitlines()[:2]
    assert first.startswith("layout auto: in_process, the diffusers engine on the trainer weights")
    assert second.startswith("machine: 1 x NVIDIA H100 80GB HBM3 (80 GiB): layout in_process, diffusers engine on "
                             "the trainer weights, 1 sample(s) per micro-batch per GPU, 256 micro-batch(es)")
