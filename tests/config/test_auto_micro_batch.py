"""train.num_micro_batches='auto': accepted by the validation stage, resolved once by the plan stage (the CPU: the
whole mini-batch; a GPU: the largest micro-batch that the planner's memory model admits on the card), then fitted
to the compiled step's memory analysis (`Learner.check_memory`); bad values are one line."""
import json
from pathlib import Path

import pytest

from jaxflow.config import machine
from jaxflow.config import plan as plan_lib
from jaxflow.config import planner, recipes, validation
from jaxflow.config.errors import UserError
from jaxflow.trainer import learner, memory
from jaxflow.trainer.sharding import Layout
from jaxflow_bench import phase_costs
from tests.helpers import tiny_config

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
H200, H100 = planner.Card("NVIDIA H200", 140.4), planner.Card("NVIDIA H100 80GB HBM3", 79.65)
TABLE = planner.load_table()
RECIPE = planner.ModelSizes(**phase_costs.RECIPE, lora_params=phase_costs.memory_row(
    json.loads((RESULTS / phase_costs.MEMORY_FILE).read_text()))[1])


def _auto(tmp_path, **train):
    return validation.validate(tiny_config(tmp_path, num_micro_batches="auto", **train))


@pytest.mark.parametrize("value, line", [
    ("most", "config.train.num_micro_batches: 'most'; give an int that divides each mini-batch's 16 samples, or "
             "'auto' (the largest micro-batch that fits)"),
    (3, "config.train.num_micro_batches: 3 must divide each mini-batch's 16 samples (train.num_mini_batches 1), or be "
        "'auto'"),
    (0, "config.train.num_micro_batches: 0 must divide each mini-batch's 16 samples (train.num_mini_batches 1), or be "
        "'auto'"),
    (2.5, "config.train.num_micro_batches: 2.5 must be an int or a str (it is float)"),
])
def test_a_bad_value_is_one_line_naming_auto(tmp_path, value, line):
    with pytest.raises(UserError) as e:
        validation.validate(tiny_config(tmp_path, num_micro_batches=value))
    assert str(e.value) == line


@pytest.mark.slow
def test_auto_on_the_cpu_is_the_whole_mini_batch_and_the_learner_takes_it(tmp_path):
    """The plan stage resolves it once; the learner's step and the micro-batch it reports are the plan's, and the
    CPU (no memory statistics) keeps it."""
    cfg = _auto(tmp_path, num_mini_batches=2)
    assert cfg.train.num_micro_batches == "auto"
    folder = validation.model_folder(cfg)
    layout = Layout.create(validation.sharding_config(cfg))
    plan = learner.run_plan(cfg, folder, layout)
    assert (plan.num_micro_batches, plan.micro_batch) == (1, 8 // layout.batch_devices)
    assert "CPU" in plan.micro_batch_why and "1 micro-batch(es) an update" in plan.summary().splitlines()[0]
    trainer = learner.Learner(cfg, folder, plan)
    assert trainer.micro_batch_size() == plan.micro_batch
    assert trainer.check_memory() is None and trainer.plan is plan


def test_train_config_refuses_an_unresolved_auto(tmp_path):
    cfg = _auto(tmp_path)
    with pytest.raises(ValueError, match="resolved by the plan stage"):
        validation.train_config(cfg, (1, 1))
    assert validation.train_config(cfg, (1, 1), num_micro_batches=4).num_micro_batches == 4


def _recipe_auto():
    cfg = recipes.base()
    cfg.train.num_micro_batches = "auto"
    return cfg


@pytest.mark.parametrize("card", [H200, H100, planner.Card("a 100 GiB card", 100)])
def test_auto_on_a_gpu_is_the_largest_the_memory_model_admits(monkeypatch, card):
    """The recipe (256 samples an update, vLLM-Omni beside JAX) on one card: the largest divisor of the update
    whose update fits beside the engine by the memory model; one sample where none fits (the compiled check then
    decides). On one H200 that is the recipe's measured 4 samples, 64 micro-batches."""
    monkeypatch.setattr(machine, "local_gpus", lambda: (card, 1))
    monkeypatch.setattr(machine, "model_sizes", lambda cfg, folder: RECIPE)
    count, why = plan_lib.num_micro_batches(_recipe_auto(), Path("unused"), "gpu", 1)
    update = planner.UpdateMemory.from_counts(RECIPE, TABLE)
    engine = planner.engine_bytes(RECIPE, planner.Layout("colocated", "vllm_omni", False),
                                  planner.engine_row(TABLE, "vllm_omni", False, card)["engine_reserve_gib"])
    admitted = [m for m in range(1, 257) if 256 % m == 0
                and update.resident + update.need(m) <= card.memory_gib * planner.GIB - engine]
    assert count == 256 // max(admitted, default=1)
    assert why.startswith("auto: the largest that the memory model admits" if admitted else "auto: 1 sample")
    if card is H200:
        assert count == 64  # the recipe's hand value (recipes.base(), configs/qwen_ocr.py)


def _step_needs(monkeypatch, need, limit):
    """Stand-ins for the compiled step (its update needs `need(samples per micro-batch)` bytes) and JAX's pool."""
    def compiled(self, step):
        samples = self.micro_batch_size(step.config.num_micro_batches)
        return [memory.StepMemory("update", 0, 0, 0, need(samples))], 0
    monkeypatch.setattr(learner.Learner, "_compiled", compiled)
    monkeypatch.setattr(memory, "pool", lambda device=None: (limit, 0))


@pytest.mark.parametrize("limit, want", [(20_000, 16), (10_000, 8), (3_000, 2), (1_500, 1)])
def test_the_compiled_analysis_takes_the_largest_that_fits_from_the_largest_down(tmp_path, monkeypatch, limit,
                                                                               want):
    """Planned the whole mini-batch (16 samples on one device) with no memory model to predict by: each smaller divisor is compiled
    until one fits the pool; the learner adopts that step and the plan says why."""
    cfg = _auto(tmp_path)
    folder = validation.model_folder(cfg)
    layout = Layout.create(validation.sharding_config(cfg))
    plan = learner.run_plan(cfg, folder, layout)
    per_device = 16 // layout.batch_devices
    trainer = learner.Learner(cfg, folder, plan)
    monkeypatch.setattr(learner.Learner, "_update_memory", lambda self, need, micro_batch: None)
    _step_needs(monkeypatch, lambda m: 1_000 * m, limit)
    want = min(want, per_device)
    line = trainer.check_memory()
    assert trainer.plan.micro_batch == trainer.micro_batch_size() == want
    assert trainer.plan.num_micro_batches == per_device // want
    assert f"{want} samples per micro-batch" in line and "does not fit" not in line
    if want != per_device:
        assert trainer.plan.micro_batch_why.startswith("auto: the largest that the compiled step's memory analysis")


def test_the_compiled_analysis_grows_a_planned_micro_batch_the_scaled_model_admits(tmp_path, monkeypatch):
    """Planned at 1 sample (a GPU plan that fitted none), the compiled need scaled by the memory model admits 4:
    tried from the largest the model admits down, the first that compiles within the pool is taken."""
    cfg = _auto(tmp_path)
    folder = validation.model_folder(cfg)
    layout = Layout.create(validation.sharding_config(cfg))
    per_device = 16 // layout.batch_devices
    plan = learner.run_plan(cfg, folder, layout).resized(per_device, 1, "auto: 1 sample")
    trainer = learner.Learner(cfg, folder, plan)
    model = planner.UpdateMemory(resident=0, fixed=0, per_sample=1_000, source="a stand-in")
    monkeypatch.setattr(learner.Learner, "_update_memory", lambda self, need, micro_batch: model)
    tried = []
    _step_needs(monkeypatch, lambda m: tried.append(m) or (1_000 * m if m < 4 else 10 ** 9), 4_500)
    trainer.check_memory()
    assert trainer.plan.micro_batch == min(2, per_device) and tried[0] == 1
    assert tried[1:] == [m for m in (4, 2) if m <= per_device and per_device % m == 0]


def test_a_set_micro_batch_count_is_said_as_set(tmp_path):
    """The plan line names why: a number the config sets is 'as set' (not the key's name again)."""
    cfg = validation.validate(tiny_config(tmp_path, num_micro_batches=2))
    layout = Layout.create(validation.sharding_config(cfg))
    line = learner.run_plan(cfg, validation.model_folder(cfg), layout).summary().splitlines()[0]
    assert line.endswith("2 micro-batch(es) an update (train.num_micro_batches: as set)")
