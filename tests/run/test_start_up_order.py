"""The start-up's order (jaxflow/train.py): engines that load in processes of their own (Ray actors) are launched
before the step compiles and joined after it, the overlap reported; an in-process engine starts after the memory
check; the driver reads the plan that the check fitted. Stand-ins for the driver and the learner record the order."""
import pytest

from jaxflow import train
from jaxflow.trainer import compile_times
from jaxflow.trainer.compile_times import CompileTime
from jaxflow.config import validation
from tests.helpers import tiny_config


def _stand_ins(monkeypatch, events, apart):
    class Learner:
        def __init__(self, cfg, folder, plan):
            events.append("model")
            self.plan, self.model = plan, object()

        def check_memory(self):
            events.append("compile")
            self.plan = self.plan.resized(4, 4, "a stand-in's fit")
            return None

        def begin(self, resume):
            events.append("train state")

        def whole_lora(self, which):
            return {}

        sampling = "lora"
        compile_times = []

    class Driver:
        loads_apart = apart

        def __init__(self, cfg, folder, items, sampler, plan):
            self.plan = plan

        def launch_rollout(self):
            events.append("launch")

        def join_rollout(self, model, processes):
            events.append(("join", self.plan.micro_batch_why))

        def serve(self, lora, version):
            events.append("sync")
            return 0

        def close(self):
            events.append("close")

    monkeypatch.setattr(train, "Learner", Learner)
    monkeypatch.setattr(train, "Driver", Driver)


@pytest.mark.parametrize("apart, order", [
    (True, ["model", "launch", "compile", ("join", "a stand-in's fit"), "train state", "sync"]),
    (False, ["model", "compile", "launch", ("join", "a stand-in's fit"), "train state", "sync"]),
])
def test_ray_engines_launch_before_the_compile_and_join_after(tmp_path, monkeypatch, apart, order):
    events = []
    _stand_ins(monkeypatch, events, apart)
    trainer = train.Trainer(validation.validate(tiny_config(tmp_path / "run")))
    assert events == order
    assert trainer.plan.micro_batch_why == "a stand-in's fit" and trainer.rollout_load_s >= 0
    assert list(trainer.startup) == ["checks", "prompts and rewards", "trainer's model", "memory plan",
                                     "rollout start", "train state and first LoRA sync"]


def test_the_overlap_is_reported_in_the_start_up_line(tmp_path, monkeypatch):
    events = []
    _stand_ins(monkeypatch, events, True)
    trainer = train.Trainer(validation.validate(tiny_config(tmp_path / "run")))
    trainer.startup["rollout start"], trainer.rollout_load_s = 3.0, 80.0
    assert trainer.startup_line().endswith("rollout start 3 s, train state and first LoRA sync 0 s; the rollout "
                                           "engines started in 80 s, 77 s of it beside the memory plan")


def test_a_failed_memory_check_closes_the_launched_engines(tmp_path, monkeypatch):
    events = []
    _stand_ins(monkeypatch, events, True)

    def no_fit(self):
        raise MemoryError("train step memory per device: it does not fit")
    monkeypatch.setattr(train.Learner, "check_memory", no_fit)
    with pytest.raises(validation.UserError, match="does not fit"):
        train.Trainer(validation.validate(tiny_config(tmp_path / "run")))
    assert events == ["model", "launch", "close"]


def test_the_memory_plan_names_its_compiles_by_stage(tmp_path, monkeypatch):
    """The start-up line's memory plan says where its seconds went: tracing and lowering (redone at every start) and
    XLA's compile, and how many compiles the persistent cache served (`jaxflow.trainer.compile_times`)."""
    events = []
    _stand_ins(monkeypatch, events, True)
    times = [CompileTime("update", 20.2, 30.4, 0.6, True), CompileTime("old_log_prob", 5.0, 6.0, 40.0, False)]
    monkeypatch.setattr(train.Learner, "compile_times", times)
    trainer = train.Trainer(validation.validate(tiny_config(tmp_path / "run")))
    trainer.startup["memory plan"] = 91.0
    assert ", memory plan 91 s (trace 25 s, lower 36 s, compile 41 s; 1 of 2 compiles from the cache, 0 of 2 " \
           "from the executable cache), rollout start" in trainer.startup_line()
    assert compile_times.summary([]) == ""
