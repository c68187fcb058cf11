"""The short-run start (`planner.short_start`, resolved by the plan stage): a run too short to repay the unrolled
blocks' longer compile runs them in a scan with XLA's linears, from the table's row measured on README's command."""
import dataclasses
import math

import pytest

from jaxflow.config import machine, planner
from jaxflow.config import plan as plan_lib
from jaxflow.config.planner import Card, Job, ModelSizes
from jaxflow_bench import phase_costs

H200, H100 = Card("NVIDIA H200", 140.4), Card("NVIDIA H100 80GB HBM3", 79.65)
TABLE = planner.load_table()
ROW = TABLE["short_start"][0]
RECIPE = ModelSizes(**phase_costs.RECIPE, lora_params=20_000_000)  # the measured model's size (`_measured_model`)


def readme_job(**change) -> Job:
    """README's GPU command: 2 prompts x 16 images a step, 3 steps, both knobs left to the plan."""
    job = Job(family="qwen_image", images=32, mini_batches=1, micro_batches=None, engine="vllm_omni",
              layout="colocated", share_weights=False, steps=3, auto_unroll=True)
    return dataclasses.replace(job, **change)


def test_the_row_is_readme_measured_both_ways():
    assert (ROW["family"], ROW["card"]) == ("qwen_image", "NVIDIA H200")
    assert ROW["compile_saving_s"] > 100 and 0 < ROW["step_extra_s_per_image"] < ROW["step_s_per_image"]


def test_readme_command_starts_short_and_the_recipe_unrolled():
    why, extra = planner.short_start(readme_job(), H200, 1, TABLE)
    assert "a short run (3 step(s) of 32 images a GPU)" in why and "scan_unroll=60" in why
    assert extra == pytest.approx(32 * ROW["step_extra_s_per_image"])
    # the recipe's own run: 300 steps of 512 images repay the compile many times
    assert planner.short_start(readme_job(images=512, steps=300), H200, 1, TABLE) is None
    # the break-even: the longest run that still starts short, and one step more
    limit = math.ceil(ROW["compile_saving_s"] / (32 * ROW["step_extra_s_per_image"])) - 1
    assert planner.short_start(readme_job(steps=limit), H200, 1, TABLE) is not None
    assert planner.short_start(readme_job(steps=limit + 1), H200, 1, TABLE) is None
    # on 2 GPUs each runs half the images a step: twice the steps before the unrolled blocks pay
    assert planner.short_start(readme_job(steps=limit + 1), H200, 2, TABLE) is not None


def test_only_where_measured_and_left_to_the_plan():
    assert planner.short_start(readme_job(auto_unroll=False), H200, 1, TABLE) is None
    assert planner.short_start(readme_job(), H100, 1, TABLE) is None
    assert planner.short_start(readme_job(family="bagel"), H200, 1, TABLE) is None


def test_max_minutes_ends_a_long_run_early():
    long = readme_job(steps=10_000)
    assert planner.short_start(long, H200, 1, TABLE) is None
    why, _ = planner.short_start(dataclasses.replace(long, max_minutes=2.0), H200, 1, TABLE)
    assert f"({math.ceil(120 / (32 * ROW['step_s_per_image']))} step(s)" in why


def test_the_prediction_adds_the_scan_cost():
    short = planner.plan_machine(readme_job(), RECIPE, H200, 1, TABLE)
    long = planner.plan_machine(readme_job(steps=10_000), RECIPE, H200, 1, TABLE)
    assert short.step_s - long.step_s == pytest.approx(32 * ROW["step_extra_s_per_image"])
    assert any("blocks in a scan, XLA's linears: auto: a short run" in w for w in short.why)
    assert not any("short run" in w for w in long.why)


def test_a_scan_set_by_hand_is_predicted_at_the_scan_cost():
    """model.scan_unroll=1 with XLA's linears, as set: the same program as the short start, the same extra cost."""
    unrolled = planner.plan_machine(readme_job(auto_unroll=False), RECIPE, H200, 1, TABLE)
    scanned = planner.plan_machine(readme_job(auto_unroll=False, scanned=True), RECIPE, H200, 1, TABLE)
    assert scanned.step_s - unrolled.step_s == pytest.approx(32 * ROW["step_extra_s_per_image"])
    assert any("model.scan_unroll=1, as set" in w for w in scanned.why)
    # where the short start already chose the scan, its cost is added once
    short = planner.plan_machine(readme_job(scanned=True), RECIPE, H200, 1, TABLE)
    assert short.step_s == pytest.approx(scanned.step_s)
    # no row for the card (the layout that fits an 80 GB one): nothing to add
    fits = dict(layout="in_process", engine="diffusers", share_weights=True)
    h100 = [planner.plan_machine(readme_job(scanned=flag, **fits), RECIPE, H100, 1, TABLE) for flag in (True, False)]
    assert h100[0].step_s == h100[1].step_s and h100[0].why == h100[1].why


def test_job_of_marks_the_hand_set_scan(tmp_path):
    from tests.helpers import tiny_config

    cfg = tiny_config(tmp_path)
    for unroll, gemm, scanned in ((1, "xla", True), (1, "auto", True), (1, "pallas", False), (0, "xla", False),
                                  (60, "xla", False)):
        cfg.model.update(scan_unroll=unroll, lora_gemm=gemm)
        assert machine.job_of(cfg).scanned is scanned, (unroll, gemm)


def test_the_plan_stage_scans_a_short_run(monkeypatch, tmp_path):
    """Where the fused kernel would run (stubbed: the tiny model is no H200 case), a short run on a measured card
    gets XLA's linears and blocks in a scan; a long one, or one with the knobs set, keeps the unrolled kernel."""
    from jaxflow.config import validation
    from tests.helpers import tiny_config

    monkeypatch.setattr(plan_lib, "lora_gemm", lambda cfg, *a: (("pallas", "auto: unrolled blocks, bf16 on "
                                                                "H100/H200s") if cfg.model.lora_gemm == "auto"
                                                               else (cfg.model.lora_gemm, "set in the config")))
    monkeypatch.setattr(machine, "local_gpus", lambda: (H200, 1))

    def plan(**model):
        cfg = tiny_config(tmp_path)
        cfg.model.update(scan_unroll=0, **model)
        cfg = validation.validate(cfg)
        return plan_lib.make_plan(cfg, validation.model_folder(cfg), backend="gpu", devices=1, batch_devices=1,
                                  on_hopper=True)

    short = plan()
    assert (short.model.lora_gemm, short.model.scan_unroll) == ("xla", 1)
    assert short.lora_gemm_why.startswith("auto: a short run")
    monkeypatch.setattr(machine, "local_gpus", lambda: (H100, 1))  # no row measured on this card
    unrolled = plan()  # started in a scan, the unrolled blocks swapped in later (model.unroll_upgrade='auto')
    assert unrolled.upgrade.model.lora_gemm == "pallas" and unrolled.upgrade.model.scan_unroll > 1
    unrolled = plan(unroll_upgrade="off")
    assert unrolled.model.lora_gemm == "pallas" and unrolled.model.scan_unroll > 1
    monkeypatch.setattr(machine, "local_gpus", lambda: (H200, 1))
    pinned = plan(lora_gemm="pallas", unroll_upgrade="off")
    assert pinned.model.lora_gemm == "pallas" and pinned.model.scan_unroll > 1
