"""The machine plan for given sizes (jaxflow/config/planner.py) and its cost table (jaxflow_bench/phase_costs.py)."""
import json
from pathlib import Path

import pytest

from jaxflow.config import planner
from jaxflow.config.planner import GIB, Card, Job, ModelSizes, NoFit, UpdateMemory, plan_machine
from jaxflow_bench import phase_costs

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
H200, H100 = Card("NVIDIA H200", 140.4), Card("NVIDIA H100 80GB HBM3", 79.65)
TABLE = planner.load_table()
LORA = phase_costs.memory_row(json.loads((RESULTS / phase_costs.MEMORY_FILE).read_text()))[1]
RECIPE = ModelSizes(**phase_costs.RECIPE, lora_params=LORA)
TINY = ModelSizes(transformer_bytes=2_000_000, text_encoder_bytes=3_000_000, vae_bytes=500_000, lora_params=20_000,
                  layers=2, tokens=50)


def job(images=32, micro_batches=None, engine="vllm_omni", layout="colocated", shared=False):
    return Job(images=images, mini_batches=1, micro_batches=micro_batches, engine=engine, layout=layout,
               share_weights=shared)


def test_table_is_what_the_writer_makes_of_the_results():
    assert phase_costs.build(RESULTS) == TABLE


def test_recipe_on_one_h200_takes_the_measured_micro_batch_and_share():
    plan = plan_machine(job(), RECIPE, H200, 1, TABLE)
    assert (plan.layout.name, plan.micro_batch, plan.num_micro_batches) == ("colocated", 4, 8)
    assert 0.54 < plan.jax_share < 0.57 and plan.jax_share + plan.engine_share == pytest.approx(1)
    runner = json.loads((RESULTS / "e2e_recipe_vllm_omni_1gpu_runner.json").read_text())["figures"]
    assert plan.step_s == pytest.approx(runner["step_s"], rel=0.02)
    assert "parameter counts" in plan.why[0]


@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_recipe_on_h200s_splits_the_batch(gpus):
    plan = plan_machine(job(), RECIPE, H200, gpus, TABLE)
    assert plan.micro_batch * plan.num_micro_batches * gpus == 32
    assert plan.img_per_gpu_s == pytest.approx(32 / (plan.step_s * gpus))


def test_recipe_on_one_h100_refuses_naming_the_shared_engine():
    with pytest.raises(NoFit, match=r"does not fit 1 x NVIDIA H100.*--config.rollout.layout=in_process "
                                    r"--config.rollout.engine=diffusers --config.rollout.share_weights=True "
                                    r"\(1 sample"):
        plan_machine(job(), RECIPE, H100, 1, TABLE)
    plan = plan_machine(job(engine="diffusers", layout="in_process", shared=True), RECIPE, H100, 1, TABLE)
    assert plan.micro_batch == 1 and plan.why[-1].startswith("costs per image measured on NVIDIA H100")


@pytest.mark.parametrize("gpus", [2, 4])
def test_recipe_on_several_h100s_refuses_in_one_line(gpus):
    with pytest.raises(NoFit, match="in any layout") as info:
        plan_machine(job(), RECIPE, H100, gpus, TABLE)
    assert "\n" not in str(info.value)


def test_a_fixed_micro_batch_too_large_names_the_one_that_fits():
    with pytest.raises(NoFit, match=r"num_micro_batches=4 does not fit.*num_micro_batches=8 \(4 sample"):
        plan_machine(job(micro_batches=4), RECIPE, H200, 1, TABLE)


def test_auto_micro_batch_is_the_largest_the_memory_model_admits():
    update = UpdateMemory.from_counts(RECIPE, TABLE)
    for card in (H200, H100, Card("a 100 GiB card", 100)):
        for j in (job(), job(engine="diffusers", layout="in_process", shared=True)):
            try:
                plan = plan_machine(j, RECIPE, card, 1, TABLE, update)
            except NoFit:
                continue
            room = card.memory_gib * GIB - planner.engine_bytes(
                RECIPE, plan.layout, planner.costs_for(TABLE, j.engine, j.share_weights, card)["engine_reserve_gib"])
            admitted = [m for m in range(1, 33) if 32 % m == 0 and update.resident + update.need(m) <= room]
            assert plan.micro_batch == max(admitted)


def test_compiled_analysis_replaces_the_counts_and_says_so():
    counts = UpdateMemory.from_counts(RECIPE, TABLE)
    tight = UpdateMemory.from_analysis(int(counts.resident), int(counts.need(4) * 1.3), 4, counts)
    plan = plan_machine(job(), RECIPE, H200, 1, TABLE, tight)
    assert plan.micro_batch == 2 and "compiled step's memory analysis" in plan.why[0]


@pytest.mark.parametrize("card", [H200, H100])
@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_tiny_model_takes_whole_mini_batches(card, gpus):
    plan = plan_machine(job(images=16, engine="diffusers"), TINY, card, gpus, TABLE)
    assert plan.micro_batch == 16 // gpus and plan.num_micro_batches == 1


def test_a_batch_that_does_not_split_over_the_gpus_is_refused():
    with pytest.raises(NoFit, match="does not split"):
        plan_machine(job(images=16), TINY, H200, 3, TABLE)
