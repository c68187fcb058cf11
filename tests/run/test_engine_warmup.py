"""The engines' warm-up request: the plan asks for it where an engine loads in a process of its own and does not serve
the LoRA as layers, beside a trainer that starts on unrolled blocks (`plan.warm_up`); the driver makes it one rollout
call's shape (`Driver.warmup_request`); the server runs it once, before any other call, and reports its seconds in its
start (`RolloutServer`, `EngineStart`)."""
from types import SimpleNamespace

import numpy as np
import pytest

from jaxflow.config import plan as plan_lib
from jaxflow.config import validation
from jaxflow.nn.config import ModelOptions
from jaxflow.run import driver as driver_lib
from jaxflow.run.data import GroupSampler, load_prompts
from jaxflow_bridge.contract.engine_start import EngineStart
from jaxflow_bridge.rollout import server as server_lib
from tests.helpers import tiny_config


class RecordingEngine:
    """An engine that records its calls and reports a start, as vLLM-Omni's does."""

    calls: list = []

    def __init__(self, config: dict):
        self.config = config
        RecordingEngine.calls = [("start", sorted(config))]

    def generate(self, prompts, n, sampling, seeds=None):
        RecordingEngine.calls.append(("generate", list(prompts), n, dict(sampling), list(seeds)))
        return {"samples": len(prompts) * n}

    def info(self) -> dict:
        return {"engine": "recording", "start": EngineStart(1.0, 2.0, 3.0).to_dict()}


@pytest.fixture
def recording(monkeypatch):
    monkeypatch.setattr(server_lib, "engine_class", lambda config: RecordingEngine)
    return RecordingEngine


def test_the_server_runs_the_warm_up_once_before_anything_else_and_reports_it(recording):
    request = {"prompts": ["a", "b"], "n": 3, "sampling": {"num_steps": 2}, "seeds": [5, 6, 7, 8, 9, 10]}
    server = server_lib.RolloutServer({"engine": "recording", "model": "m", "warmup": request})
    assert recording.calls == [("start", ["engine", "model"]),  # the engine never sees the warm-up key
                               ("generate", ["a", "b"], 3, {"num_steps": 2}, [5, 6, 7, 8, 9, 10])]
    assert server.warmup_s is not None and server.warmup_s >= 0
    start = EngineStart.from_dict(server.info()["start"])
    assert start.warmup == server.warmup_s and start.total == pytest.approx(6.0 + server.warmup_s)


def test_without_a_warm_up_the_server_generates_nothing_at_start(recording):
    server = server_lib.RolloutServer({"engine": "recording", "model": "m"})
    assert recording.calls == [("start", ["engine", "model"])] and server.warmup_s is None
    assert EngineStart.from_dict(server.info()["start"]) == EngineStart(1.0, 2.0, 3.0)


def test_the_start_summary_names_the_warm_up_only_where_one_ran():
    assert EngineStart(7.0, 29.0, 0.0).summary() == "imports 7 s, engine 29 s, checks 0 s"
    assert EngineStart(7.0, 29.0, 0.0, 41.0).summary() == "imports 7 s, engine 29 s, checks 0 s, warm-up 41 s"
    assert EngineStart.from_dict({"imports": 1, "engine": 2, "checks": 3}).warmup == 0.0  # an engine of before


@pytest.mark.parametrize("engine, layout, lora_apply, quantization, expected", [
    ("vllm_omni", "colocated", "auto", "none", True),  # the recipe: merged, in a Ray actor
    ("vllm_omni", "split", "merged", "none", True),
    ("vllm_omni", "colocated", "layers", "none", False),  # layers swapped in at the first sync redo the compile
    ("vllm_omni", "colocated", "auto", "fp8", False),  # FP8 serves the LoRA as layers
    ("diffusers", "colocated", "auto", "none", False),  # its LoRA is layers
    ("vllm_omni", "in_process", "auto", "none", False),  # the trainer would wait for it
])
def test_the_plan_warms_up_engines_that_load_apart_and_merge(tmp_path, engine, layout, lora_apply, quantization,
                                                             expected):
    cfg = tiny_config(tmp_path)
    cfg.rollout.engine, cfg.rollout.layout, cfg.rollout.lora_apply = engine, layout, lora_apply
    cfg.rollout.quantization = quantization
    unrolled, scanned = ModelOptions(scan_unroll=60), ModelOptions(scan_unroll=1)
    assert plan_lib.warm_up(cfg, unrolled, 60) is expected
    # beside a trainer that starts on a scan (seconds of compile) nothing would hide it
    assert plan_lib.warm_up(cfg, scanned, 60) is False


@pytest.mark.parametrize("warmup", [True, False])
def test_the_warm_up_request_is_one_rollout_call_of_the_first_step(tmp_path, monkeypatch, warmup):
    user = tiny_config(tmp_path)
    user.sample.prompts_per_call = 2
    cfg = validation.validate(user)
    s = cfg.sample
    items = load_prompts(cfg.data.train, False)
    plan = SimpleNamespace(lora_apply="merged", quantization="none", engines=1, warmup=warmup)
    launched = []
    monkeypatch.setattr(driver_lib, "init_ray", lambda address: None)
    monkeypatch.setattr(driver_lib, "RolloutGroup", lambda engine, count, transport: launched.append(engine))
    driver = driver_lib.Driver(cfg, tmp_path, items, GroupSampler(len(items), s.prompts_per_step, s.group_size,
                                                                  cfg.seed), plan=plan)
    try:
        driver.launch_rollout()
        request = driver.warmup_request()
    finally:
        driver.close()
    assert launched[0].get("warmup") == (request if warmup else None)  # the plan decides; the engines get it
    assert request["prompts"] == [it.prompt for it in items[:2]] and request["n"] == s.group_size
    full = driver_lib.registry.rollout_sampling(driver_lib.sampling(cfg), cfg, 0)
    assert request["sampling"] == {**full, "num_inference_steps": driver_lib.WARMUP_STEPS, "sde_window_size": 1,
                                   "sde_window_range": (0, 1)}  # the call's shapes, the fewest steps with a window
    assert full["num_inference_steps"] > driver_lib.WARMUP_STEPS
    assert request["seeds"] == [int(x) for x in driver_lib.sample_seeds(cfg.seed, 0, 2 * s.group_size)]
    assert "references" not in request and all(type(x) is int for x in request["seeds"])
    assert len(set(request["seeds"])) == len(request["seeds"]) and np.ndim(request["seeds"]) == 1
