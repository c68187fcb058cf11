"""scripts/verify_logprob_parity.py in-process: diffusers rollout vs the train step's JAX log-prob, tiny fp32, CFG 4
(Qwen-Image, and Qwen-Image-Edit with its reference images); and --model-family bagel: the bagel_torch rollout of the tiny BAGEL vs the train step's BAGEL log-prob (also in think
mode)."""

import dataclasses
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers_vllm_omni import synthetic_batch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "verify_logprob_parity.py"
TINY = ["--dtype", "float32", "--cfg", "4", "--prompts", "2", "--n", "2", "--steps", "4", "--window", "2"]


@pytest.fixture(scope="module")
def parity():
    spec = importlib.util.spec_from_file_location("verify_logprob_parity", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(parity, tmp_path, *extra) -> tuple[int, dict]:
    out = tmp_path / "parity.json"
    code = parity.main([*TINY, *extra, "--json", str(out)])
    return code, json.loads(out.read_text())


@pytest.mark.parametrize("extra", [(), ("--lora-rank", "4"), ("--cfg-forward", "split")],
                         ids=["base", "lora", "split_cfg"])
def test_fp32_recompute_matches_rollout(parity, tmp_path, tiny_path, extra):
    code, report = _run(parity, tmp_path, *extra)
    assert code == 0 and report["passed"]
    assert len(report["dlogp"]) == 4 and len(report["per_step"]) == 2
    assert report["overall"]["p99"] <= 1e-6
    assert abs(report["overall"]["ratio_min"] - 1) <= 1e-6 and abs(report["overall"]["ratio_max"] - 1) <= 1e-6


def test_random_init_on_a_folder_without_transformer_weights_matches_rollout(parity, tmp_path, tiny_path):
    """--init random: the engine draws the base weights from --seed (not the folder's: its fingerprint differs) and
    JAX draws the same, within the float32 threshold; the folder's transformer/ holds its config.json alone, as a
    full-size folder from make_random_pipeline.py --no-transformer-weights, so neither side reads weights there."""
    folder = tmp_path / "no_transformer_weights"
    (folder / "transformer").mkdir(parents=True)
    for part in tiny_path.iterdir():
        if part.name != "transformer":
            (folder / part.name).symlink_to(part)
    (folder / "transformer" / "config.json").write_bytes((tiny_path / "transformer" / "config.json").read_bytes())
    code, report = _run(parity, tmp_path, "--model", str(folder), "--init", "random", "--lora-rank", "4")
    assert code == 0 and report["passed"] and len(report["dlogp"]) == 4
    assert report["overall"]["p99"] <= 1e-6
    from_folder = parity.build_engine("diffusers", tiny_path, "float32")
    assert report["fingerprint"] != from_folder.info()["fingerprint"]


def test_sleep_cycles_run_after_the_adapter_and_before_the_rollout(parity, tmp_path, tiny_path, monkeypatch, capsys):
    """--sleep-cycles 2: the engine sleeps and wakes twice between update_lora and generate (the header says so),
    and the check still passes."""
    calls, build = [], parity.build_engine

    def recording(*args):
        engine = build(*args)
        for name in ("update_lora", "sleep", "wake", "generate"):
            method = getattr(engine, name)
            setattr(engine, name, lambda *a, _m=method, _n=name, **k: calls.append(_n) or _m(*a, **k))
        return engine

    monkeypatch.setattr(parity, "build_engine", recording)
    code, report = _run(parity, tmp_path, "--lora-rank", "4", "--sleep-cycles", "2")
    assert code == 0 and report["passed"]
    assert calls == ["update_lora", "sleep", "wake", "sleep", "wake", "generate", "sleep"]  # the last frees for JAX
    assert "2 sleep/wake cycle(s) before the rollout" in capsys.readouterr().out


def test_init_and_sleep_cycles_bad_combinations_and_the_seed_reaching_the_engine(parity, capsys, monkeypatch):
    for argv, needle in ((["--sleep-cycles", "-1"], "--sleep-cycles must be >= 0"),
                         (["--model-family", "bagel", "--engine", "vllm_omni", "--dtype", "bfloat16", "--init",
                           "random"], "--init random on --engine vllm_omni: 'random': BAGEL runs with 'checkpoint'")):
        with pytest.raises(SystemExit):
            parity.main(argv)
        assert needle in capsys.readouterr().err
    seen = []
    monkeypatch.setattr("jaxflow_bridge.rollout.server.engine_class", lambda config: seen.append(config) or dict)
    parity.build_engine("vllm_omni", Path("/m"), "bfloat16", random_seed=3)
    assert seen == [{"engine": "vllm_omni", "model": "/m", "dtype": "bfloat16", "random_seed": 3}]


def test_a_different_jax_adapter_fails(parity, tmp_path, tiny_path):
    code, report = _run(parity, tmp_path, "--lora-rank", "4", "--jax-lora-seed", "1")
    assert code == 1 and not report["passed"]


def test_the_engine_is_closed_when_the_rollout_fails(parity, monkeypatch):
    """An engine error ends the check with the engine closed (a two-stage vLLM-Omni BAGEL otherwise kept its
    process waiting on its stage processes after the traceback)."""
    closed = []

    class Failing:
        def info(self):
            return {"fingerprint": "0"}

        def generate(self, *args):
            raise RuntimeError("the stage failed")

        def close(self):
            closed.append(True)

    monkeypatch.setattr(parity, "build_engine", lambda *args: Failing())
    with pytest.raises(RuntimeError, match="the stage failed"):
        parity.main(TINY)
    assert closed == [True]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine may have vllm_omni")
def test_an_unavailable_engine_is_a_clear_error(parity):
    with pytest.raises(SystemExit, match="'vllm_omni' is not available here"):
        parity.main(["--engine", "vllm_omni", "--dtype", "bfloat16"])


def test_vllm_omni_in_float32_is_refused_before_anything_loads(parity, capsys):
    with pytest.raises(SystemExit):
        parity.main(["--engine", "vllm_omni"])  # --dtype defaults to float32
    assert "runs --dtype bfloat16 only" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("cfg", ["4", "1"], ids=["cfg4", "cfg1"])
def test_bagel_fp32_recompute_matches_the_bagel_torch_rollout(parity, tmp_path, cfg):
    """Float32 on both sides with a rank-4 adapter: |dlogp| within the script's float32 threshold (1e-5; its
    floor is a few ulps of logp), the fingerprint of the JAX model the engine's (checked by the script)."""
    code, report = _run(parity, tmp_path, "--model-family", "bagel", "--lora-rank", "4", "--cfg", cfg)
    assert code == 0 and report["passed"] and len(report["dlogp"]) == 4
    assert report["args"]["engine"] == "bagel_torch" and report["args"]["height"] == 64


@pytest.mark.slow
def test_bagel_think_mode_recompute_matches_the_bagel_torch_rollout(parity, tmp_path):
    """Think mode (at most 24 think tokens): the trainer rebuilds each context, think tokens included, from the
    carried prompt_ids, within the same float32 threshold as without think."""
    from transformers import Qwen2TokenizerFast

    from jaxflow_bridge.families.bagel.engine import context_ids
    from jaxflow_bridge.families.bagel.tiny import tiny_bagel_path

    code, report = _run(parity, tmp_path, "--model-family", "bagel", "--lora-rank", "4", "--think", "24")
    assert code == 0 and report["passed"] and report["args"]["think"] == 24
    tokenizer = Qwen2TokenizerFast.from_pretrained(tiny_bagel_path())
    plain = [len(context_ids(tokenizer, p)) for p in parity.PROMPTS[:2] for _ in range(2)]
    think = [got - want for got, want in zip(report["context_tokens"], plain)]
    assert all(1 <= t <= 24 for t in think) and max(think) > 1, think


def test_bagel_think_with_a_token_missing_from_the_context_fails(parity, tmp_path, monkeypatch):
    """The negative control: the trainer's context one think token short (the last masked off) fails."""
    recompute = parity.recompute

    def short(model, batch, **kw):
        mask = batch.prompt_mask.copy()
        mask[np.arange(len(mask)), mask.sum(1) - 1] = False
        return recompute(model, dataclasses.replace(batch, prompt_mask=mask), **kw)

    monkeypatch.setattr(parity, "recompute", short)
    code, report = _run(parity, tmp_path, "--model-family", "bagel", "--think", "24")
    assert code == 1 and not report["passed"]


@pytest.mark.slow
def test_bagel_with_a_different_jax_adapter_fails(parity, tmp_path):
    code, report = _run(parity, tmp_path, "--model-family", "bagel", "--lora-rank", "4", "--jax-lora-seed", "1")
    assert code == 1 and not report["passed"]


def test_an_engine_of_the_other_family_is_refused(parity, capsys):
    with pytest.raises(SystemExit):
        parity.main(["--model-family", "bagel", "--engine", "diffusers"])
    assert "--engine diffusers does not serve --model-family bagel" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parity.main(["--think", "8"])
    assert "--think is BAGEL's think mode: pass --model-family bagel" in capsys.readouterr().err


def test_deploy_is_bagels_on_vllm_omni_and_reaches_the_engine(parity, capsys, monkeypatch):
    for argv, needle in ((["--deploy", "two_stage"], "--deploy is BAGEL's vLLM-Omni deployment"),
                         (["--model-family", "bagel", "--engine", "vllm_omni", "--dtype", "bfloat16", "--deploy",
                           "two_stage", "--think", "8"], "--deploy two_stage has no think mode")):
        with pytest.raises(SystemExit):
            parity.main(argv)
        assert needle in capsys.readouterr().err
    seen = []
    monkeypatch.setattr("jaxflow_bridge.rollout.server.engine_class", lambda config: seen.append(config) or dict)
    parity.build_engine("vllm_omni", Path("/m"), "bfloat16", None, "two_stage")
    assert seen == [{"engine": "vllm_omni", "model": "/m", "dtype": "bfloat16", "deploy": "two_stage"}]



def test_quantization_and_eager_are_vllm_omnis_and_reach_the_engine(parity, capsys, monkeypatch, tmp_path):
    for flag in (["--quantization", "fp8"], ["--enforce-eager"]):
        with pytest.raises(SystemExit):
            parity.main(flag)
        assert f"{flag[0]} is an option of --engine vllm_omni" in capsys.readouterr().err
    seen = []

    def engine_class(config):
        seen.append(config)
        raise ValueError("not started in this test")

    monkeypatch.setattr("jaxflow_bridge.rollout.server.engine_class", engine_class)
    argv = ["--engine", "vllm_omni", "--dtype", "bfloat16", "--model-family", "qwen_image", "--model", str(tmp_path)]
    for extra in ([], ["--quantization", "fp8", "--enforce-eager"]):
        with pytest.raises(SystemExit, match="not started in this test"):
            parity.main([*argv, *extra])
    base = {"engine": "vllm_omni", "model": str(tmp_path), "dtype": "bfloat16"}
    assert seen == [base, {**base, "quantization": "fp8", "omni_args": {"enforce_eager": True}}]


def test_cfg_forward_reaches_a_qwen_engine_and_is_refused_for_bagel(parity, capsys, monkeypatch, tmp_path):
    with pytest.raises(SystemExit):
        parity.main(["--model-family", "bagel", "--cfg-forward", "split"])
    assert "--cfg-forward is the Qwen-Image engines'" in capsys.readouterr().err
    seen = []

    def engine_class(config):
        seen.append(config)
        raise ValueError("not started in this test")

    monkeypatch.setattr("jaxflow_bridge.rollout.server.engine_class", engine_class)
    with pytest.raises(SystemExit, match="not started in this test"):
        parity.main(["--engine", "vllm_omni", "--dtype", "bfloat16", "--model-family", "qwen_image", "--model",
                     str(tmp_path), "--cfg-forward", "split"])
    assert seen == [{"engine": "vllm_omni", "model": str(tmp_path), "dtype": "bfloat16", "cfg_forward": "split"}]


def test_a_rollout_with_non_finite_log_probs_fails_before_jax_loads(parity, capsys, monkeypatch):
    """An FP8 rollout returned NaN log-probs (an H200 run): the check names that, rather than a NaN |dlogp|."""
    batch = synthetic_batch(n=3)
    batch.log_probs[1, 0] = np.nan

    class NaNEngine:
        def info(self):
            return {"fingerprint": "0"}

        def generate(self, *args, **kwargs):
            return batch.to_dict()

        def sleep(self):
            return 0

        def close(self):
            pass

    def no_jax(*args, **kwargs):
        raise AssertionError("JAX loaded after a non-finite rollout")

    monkeypatch.setattr(parity, "build_engine", lambda *args: NaNEngine())
    monkeypatch.setattr(parity, "load_transformer", no_jax)
    assert parity.main(TINY) == 1
    assert "FAIL: 1 of 6 rollout log-probs are not finite (latents: 0 of" in capsys.readouterr().out

@pytest.mark.slow
def test_edit_fp32_recompute_matches_the_diffusers_rollout(parity, tmp_path):
    """--model-family qwen_image_edit on the diffusers engine (tiny Qwen-Image-Edit, fp32, CFG 4, rank-4 adapter):
    the trainer's edit objective over the trajectory's reference latents within the float32 threshold."""
    code, report = _run(parity, tmp_path, "--model-family", "qwen_image_edit", "--lora-rank", "4")
    assert code == 0 and report["passed"] and len(report["dlogp"]) == 4
    assert report["args"]["model"].endswith("-float32") and "qwen_image_edit" in report["args"]["model"]
    assert report["overall"]["p99"] <= 1e-6


@pytest.mark.slow
def test_edit_recompute_without_the_reference_latents_fails(parity, tmp_path, monkeypatch):
    """The negative control: the trainer's reference latents zeroed fails the same check."""
    recompute = parity.recompute

    def blind(model, batch, **kw):
        refs = np.zeros_like(batch.reference_latents)
        return recompute(model, dataclasses.replace(batch, reference_latents=refs), **kw)

    monkeypatch.setattr(parity, "recompute", blind)
    code, report = _run(parity, tmp_path, "--model-family", "qwen_image_edit")
    assert code == 1 and not report["passed"]


def test_the_family_follows_the_model_folder(parity, capsys, tmp_path):
    from jaxflow_bridge.families.qwen_image_edit.tiny import tiny_pipeline_path

    assert parity.parse_args(["--model", str(tiny_pipeline_path())]).model_family == "qwen_image_edit"
    assert parity.parse_args([]).model_family == "qwen_image"
    with pytest.raises(SystemExit, match="is no family's folder"):
        parity.parse_args(["--model", str(tmp_path)])


def test_the_edit_default_size_on_vllm_omni_is_one_its_pre_processing_keeps(parity):
    """vLLM-Omni's edit pre-processing keeps multiples of 16 only: 48 x 80 there, 40 x 72 on diffusers."""
    edit = ["--model-family", "qwen_image_edit"]
    args = parity.parse_args([*edit, "--engine", "vllm_omni", "--dtype", "bfloat16"])
    assert (args.height, args.width) == (48, 80)
    assert (lambda a: (a.height, a.width))(parity.parse_args(edit)) == (40, 72)
    assert parity.parse_args(["--model-family", "bagel"]).engine == "bagel_torch"
