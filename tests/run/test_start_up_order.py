"""The start-up's order (jaxflow/train.py): engines that load in processes of their own (Ray actors) are launched
before the trainer's model is built and joined after the train state is made, the overlap reported; an in-process
engine starts after the memory check, before the train state; the unroll upgrade's build starts after the train
state; the driver reads the plan that the check fitted; a failure after the launch closes the driver. Stand-ins for the driver and the learner record the order."""
import pytest

from jaxflow import train
from jaxflow.trainer import compile_times
from jaxflow.trainer.compile_times import CompileTime
from jaxflow.config import validation
from jaxflow_bridge.contract.engine_start import EngineStart
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

        def start_upgrade(self):
            events.append("upgrade")

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

        def sync_summary(self, seconds):
            return ""

        def close(self):
            events.append("close")

    monkeypatch.setattr(train, "Learner", Learner)
    monkeypatch.setattr(train, "Driver", Driver)


APART = ["checks", "prompts and rewards", "trainer's model", "memory plan", "train state",
         "waiting for the rollout engines", "first LoRA sync"]
IN_PROCESS = ["checks", "prompts and rewards", "trainer's model", "memory plan", "rollout start", "train state",
              "first LoRA sync"]


@pytest.mark.parametrize("apart, order, phases", [
    (True, ["launch", "model", "compile", "train state", "upgrade", ("join", "a stand-in's fit"), "sync"], APART),
    (False, ["model", "compile", "launch", ("join", "a stand-in's fit"), "train state", "upgrade", "sync"],
     IN_PROCESS),
])
def test_ray_engines_launch_before_the_model_and_are_waited_for_after_the_train_state(tmp_path, monkeypatch, apart,
                                                                                       order, phases):
    events = []
    _stand_ins(monkeypatch, events, apart)
    trainer = train.Trainer(validation.validate(tiny_config(tmp_path / "run")))
    assert events == order
    assert trainer.plan.micro_batch_why == "a stand-in's fit" and trainer.rollout_load_s >= 0
    assert list(trainer.startup) == phases


def test_the_overlap_is_reported_in_the_start_up_line(tmp_path, monkeypatch):
    events = []
    _stand_ins(monkeypatch, events, True)
    trainer = train.Trainer(validation.validate(tiny_config(tmp_path / "run")))
    trainer.startup.update({"trainer's model": 10.0, "memory plan": 33.0, "train state": 4.0,
                            "waiting for the rollout engines": 3.0})
    trainer.rollout_load_s = 50.0
    assert trainer.startup_line().endswith(
        "waiting for the rollout engines 3 s, first LoRA sync 0 s; the rollout engines started in 50 s, 47 s of it "
        "beside the trainer's model, the memory plan and the train state")


def test_phases_before_the_trainer_come_first_and_count_in_the_total(tmp_path, monkeypatch):
    """The command line's start of Ray runs before the trainer is built: named first and counted in the total."""
    events = []
    _stand_ins(monkeypatch, events, True)
    trainer = train.Trainer(validation.validate(tiny_config(tmp_path / "run")))
    trainer.startup.update({name: 0.0 for name in trainer.startup})
    trainer.startup.update({"trainer's model": 10.0, "memory plan": 33.0})
    line = trainer.startup_line({"Ray": 4.0})
    assert line.startswith("start-up 47 s: Ray 4 s, checks 0 s, prompts and rewards 0 s, trainer's model 10 s, ")
    assert trainer.startup_line().startswith("start-up 43 s: checks 0 s, ")


def test_the_first_syncs_parts_are_named(tmp_path, monkeypatch):
    """The first LoRA sync's parts (the driver's `sync_summary` of the phases recorded around it) in its phase."""
    events, recorded = [], []
    _stand_ins(monkeypatch, events, True)
    monkeypatch.setattr(train.Driver, "serve", lambda self, lora, version: train.phases.add("sync_write", 1.0) or 0)
    monkeypatch.setattr(train.Driver, "sync_summary",
                        lambda self, seconds: recorded.append(dict(seconds)) or "write 1 s, engines 11 s")
    trainer = train.Trainer(validation.validate(tiny_config(tmp_path / "run")))
    assert recorded == [{"sync_write": 1.0}]
    assert "first LoRA sync 0 s (write 1 s, engines 11 s)" in trainer.startup_line()


def test_an_in_process_engine_reports_no_overlap(tmp_path, monkeypatch):
    events = []
    _stand_ins(monkeypatch, events, False)
    trainer = train.Trainer(validation.validate(tiny_config(tmp_path / "run")))
    trainer.startup["rollout start"], trainer.rollout_load_s = 3.0, 80.0
    assert trainer.startup_line().endswith("rollout start 3 s, train state 0 s, first LoRA sync 0 s")


@pytest.mark.parametrize("apart", [True, False], ids=["ray", "in_process"])
def test_the_engines_own_start_parts_are_named(tmp_path, monkeypatch, apart):
    """An engine that reports where its start went (vllm_omni's `EngineStart`, the slowest engine's from
    `Driver.join_rollout`): named beside its whole start (Ray actors) or as its phase's detail (in process)."""
    events = []
    _stand_ins(monkeypatch, events, apart)
    monkeypatch.setattr(train.Driver, "join_rollout", lambda self, model, processes: EngineStart(9.0, 47.0, 3.0))
    trainer = train.Trainer(validation.validate(tiny_config(tmp_path / "run")))
    if apart:
        trainer.startup.update({"trainer's model": 10.0, "memory plan": 33.0, "train state": 4.0,
                                "waiting for the rollout engines": 28.0})
        trainer.rollout_load_s = 75.0
        assert trainer.startup_line().endswith(
            "the rollout engines started in 75 s (imports 9 s, engine 47 s, checks 3 s), 47 s of it beside the "
            "trainer's model, the memory plan and the train state")
    else:
        trainer.startup["rollout start"] = 60.0
        assert "rollout start 60 s (imports 9 s, engine 47 s, checks 3 s), train state" in trainer.startup_line()


def test_a_failed_memory_check_closes_the_launched_engines(tmp_path, monkeypatch):
    events = []
    _stand_ins(monkeypatch, events, True)

    def no_fit(self):
        raise MemoryError("train step memory per device: it does not fit")
    monkeypatch.setattr(train.Learner, "check_memory", no_fit)
    with pytest.raises(validation.UserError, match="does not fit"):
        train.Trainer(validation.validate(tiny_config(tmp_path / "run")))
    assert events == ["launch", "model", "close"]


@pytest.mark.parametrize("fails", ["model", "begin", "join", "serve"])
def test_a_failure_after_the_launch_closes_the_driver(tmp_path, monkeypatch, fails):
    """The trainer's model, the train state, the wait for the engines and the first sync each fail after the
    engines were launched: the driver (and with it the engines) is closed."""
    events = []
    _stand_ins(monkeypatch, events, True)

    def broken(*args):
        raise RuntimeError(f"{fails} failed")
    owner = train.Driver if fails in ("join", "serve") else train.Learner
    monkeypatch.setattr(owner, {"model": "__init__", "join": "join_rollout"}.get(fails, fails), broken)
    with pytest.raises(RuntimeError, match=f"{fails} failed"):
        train.Trainer(validation.validate(tiny_config(tmp_path / "run")))
    assert events[0] == "launch" and events[-1] == "close"


def test_the_memory_plan_names_its_compiles_by_stage(tmp_path, monkeypatch):
    """The start-up line's memory plan says where its seconds went: tracing and lowering (redone at every start) and
    XLA's compile, how many compiles the persistent cache served, and the results XLA's autotune cache held before
    them (`jaxflow.trainer.compile_times`)."""
    events = []
    _stand_ins(monkeypatch, events, True)
    times = [CompileTime("update", 20.2, 30.4, 0.6, True), CompileTime("old_log_prob", 5.0, 6.0, 40.0, False)]
    monkeypatch.setattr(train.Learner, "compile_times", times)
    monkeypatch.setattr(compile_times, "autotune_results", lambda: 7)  # what an earlier run's compiles tuned
    trainer = train.Trainer(validation.validate(tiny_config(tmp_path / "run")))
    trainer.startup["memory plan"] = 91.0
    assert ", memory plan 91 s (trace 25 s, lower 36 s, compile 41 s; 1 of 2 compiles from the cache, 0 of 2 " \
           "from the executable cache, XLA's autotune cache held 7 results), train state" in trainer.startup_line()
    assert compile_times.summary([]) == ""


@pytest.mark.parametrize("apart", [True, False], ids=["ray", "in_process"])
def test_resume_takes_the_start_step_and_the_sampler_from_the_checkpoint(tmp_path, monkeypatch, apart):
    """A resumed start, in either order: the checkpoint's step is the start step and the first sync's version, and
    the sampler (the driver's own) continues from the checkpoint's position."""
    events = []
    _stand_ins(monkeypatch, events, apart)
    saved = {}
    monkeypatch.setattr(train.Learner, "begin", lambda self, resume: {"step": 3, "sampler": saved} if resume else None)
    monkeypatch.setattr(train.Driver, "serve", lambda self, lora, version: events.append(("sync", version)) or 0)
    cfg = validation.validate(tiny_config(tmp_path / "run"))
    fresh = train.Trainer(cfg)
    saved.update(fresh.sampler.state_dict(), step=3)
    assert fresh.start == 0 and events[-1] == ("sync", 0)
    trainer = train.Trainer(cfg, resume=True)
    assert trainer.start == 3 and trainer.sampler.step == 3 and events[-1] == ("sync", 3)
