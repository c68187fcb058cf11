"""Engine faults through the rollout client and the Ray server: an engine out of memory (torch's CUDA OOM, raised
by a stand-in engine on the CPU) ends the call at once as `EngineOutOfMemory`, never restarted and retried; an
engine whose actor dies in its creation at start-up ends it at once as `EngineDidNotStart`; an actor that dies later
is restarted and the call retried, and when the retries run out the error names the last death's cause. The command
line turns each into one line."""
from types import SimpleNamespace

import numpy as np
import pytest

from jaxflow.run import cli
from jaxflow.run.rollout_client import (EngineDidNotStart, EngineOutOfMemory, RayTransport, RolloutDied, RolloutGroup,
                                        engine_out_of_memory)
from jaxflow_bridge.rollout.server import RolloutServer
from tests.helpers import cli_run_raising

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB"


class OomEngine:
    """Raises torch's CUDA OOM in `fail_in` ('start' or 'generate': unless sampling asks for another error)."""

    def __init__(self, fail_in: str):
        import torch
        self.error = lambda: torch.cuda.OutOfMemoryError(OOM)
        if fail_in == "start":
            raise self.error()
        self.fail_in = fail_in

    def generate(self, prompts, n, sampling, seeds=None):
        if self.fail_in == "generate" and not sampling.get("other_error"):
            raise self.error()
        raise RuntimeError("the stand-in engine generates nothing")

    def info(self) -> dict:
        return {"engine": "oom_stand_in"}


class OomServer(RolloutServer):
    """The Ray server's methods on the stand-in engine."""

    def __init__(self, config: dict):
        self.engine = OomEngine(config["fail_in"])


class BrokenServer(RolloutServer):
    """A server whose engine's start fails as vLLM-Omni's did when its worker process died while starting."""

    def __init__(self, config: dict):
        try:
            raise EOFError
        except EOFError as e:
            raise RuntimeError("Orchestrator initialization failed") from e


class CountingTransport(RayTransport):
    """RayTransport starting `OomServer` actors, counting the starts (a restart starts fresh ones)."""

    starts = 0

    def start(self, config: dict):
        import ray
        self.starts += 1
        server = BrokenServer if config.get("fail_in") == "creation" else OomServer
        return ray.remote(server).options(num_cpus=0).remote(config)


def _group(fail_in: str):
    transport = CountingTransport(num_cpus=0, max_retries=2)
    return RolloutGroup({"fail_in": fail_in}, 1, transport), transport


@pytest.mark.slow  # starts Ray (the ray_session fixture) and Ray actors
def test_an_engine_out_of_memory_in_generate_is_not_retried(ray_session):
    group, transport = _group("generate")
    try:
        with pytest.raises(EngineOutOfMemory, match=r"OutOfMemoryError: CUDA out of memory\. Tried to allocate"):
            group.generate(["a"], 2, {}, np.arange(2), 1)
        assert transport.starts == 1  # the actor was neither restarted nor the call retried
        with pytest.raises(RuntimeError, match="generates nothing") as other:  # any other error passes as it is
            group.generate(["a"], 2, {"other_error": True}, np.arange(2), 1)
        assert not isinstance(other.value, EngineOutOfMemory)
    finally:
        group.close()


@pytest.mark.slow  # starts Ray (the ray_session fixture) and Ray actors
def test_an_engine_that_dies_of_out_of_memory_at_start_is_not_restarted(ray_session):
    """The actor dies in its creation (Ray's RayActorError, the restart path's trigger): one start, no retries."""
    group, transport = _group("start")
    try:
        with pytest.raises(EngineOutOfMemory, match="CUDA out of memory") as err:
            group.info()
        assert isinstance(err.value.__cause__, ray_session.exceptions.RayActorError)
        assert transport.starts == 1
    finally:
        group.close()


@pytest.mark.slow  # starts Ray (the ray_session fixture) and Ray actors
def test_an_engine_whose_actor_dies_in_its_creation_at_start_up_is_not_restarted(ray_session):
    """Ray's error for an actor whose constructor raised (`actor_init_failed`): one start, the error's last line."""
    transport = CountingTransport(num_cpus=0, max_retries=2)
    group = RolloutGroup({"fail_in": "creation", "engine": "vllm_omni", "device": "cuda:0"}, 1, transport)
    try:
        with pytest.raises(EngineDidNotStart) as err:
            group.info()
        assert str(err.value) == ("the rollout engine did not start (vllm_omni on cuda:0): RuntimeError: Orchestrator "
                                  "initialization failed")
        assert isinstance(err.value.__cause__, ray_session.exceptions.RayActorError)
        assert transport.starts == 1
    finally:
        group.close()


class ScriptedTransport(RayTransport):
    """RayTransport over stand-in actors, no Ray cluster: each call's outcome is the next of `script` (an exception is
    raised, anything else is every server's result); starts counted."""

    def __init__(self, script: list, max_retries: int = 2):
        super().__init__(num_cpus=0, max_retries=max_retries)
        self.script, self.starts = list(script), 0

    def start(self, config: dict):
        self.starts += 1
        return object()

    def submit(self, server, method: str, *args):
        return method

    def get(self, refs):
        outcome = self.script.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return [outcome for _ in refs]

    def kill(self, server) -> None:
        pass


def _died(init_failed: bool, last: str):
    """Ray's error for a dead actor: in its creation task (its constructor's traceback, coloured as Ray prints it) or
    later (its process gone)."""
    import ray
    head = ("The actor died because of an error raised in its creation task, \x1b[36mray::RolloutServer.__init__()"
            "\x1b[39m (pid=7)\n  File \"server.py\", line 9, in __init__\n" if init_failed else
            "The actor died unexpectedly before finishing this task.\n\tclass_name: RolloutServer\n\tpid: 7\n")
    return ray.exceptions.RayActorError(error_msg=head + last, actor_init_failed=init_failed)


KILLED = "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR"


def test_a_creation_failure_at_start_up_is_one_line_and_not_retried():
    transport = ScriptedTransport([_died(True, "RuntimeError: no model_index.json in /m\n"), {"fingerprint": "x"}])
    group = RolloutGroup({"engine": "diffusers", "device": "cpu"}, 2, transport)
    with pytest.raises(EngineDidNotStart, match=r"^the rollout engine did not start \(diffusers on cpu\): "
                                                r"RuntimeError: no model_index\.json in /m$"):
        group.info()
    assert transport.starts == 2  # the two servers' first start, no restart


def test_a_death_after_start_up_is_restarted_and_retried_with_a_one_line_warning(caplog):
    """After a call returned, a killed actor is restarted; so is a restarted one that dies in its creation."""
    transport = ScriptedTransport([{"a": 1}, _died(False, KILLED), _died(True, "RuntimeError: busy"), {"a": 2}])
    group = RolloutGroup({"engine": "diffusers", "device": "cpu"}, 1, transport)
    assert group.info() == [{"a": 1}]
    with caplog.at_level("WARNING", logger="jaxflow.run.rollout_client"):
        assert group.info() == [{"a": 2}]
    assert transport.starts == 3
    assert [r.getMessage() for r in caplog.records] == [
        f"rollout actor died ({KILLED}); restarting and retrying (1 of 2)",
        "rollout actor died (RuntimeError: busy); restarting and retrying (2 of 2)"]


def test_retries_run_out_with_the_last_cause_named():
    transport = ScriptedTransport([{"a": 1}] + [_died(False, f"{KILLED} {i}") for i in range(3)])
    group = RolloutGroup({"engine": "diffusers", "device": "cpu"}, 1, transport)
    group.info()
    with pytest.raises(RolloutDied) as err:
        group.info()
    assert str(err.value) == f"the rollout actor died 3 times; giving up: the last time: {KILLED} 2"
    assert transport.starts == 3


@pytest.mark.parametrize("text, found", [
    ("ray::RolloutServer.generate()\n  File x.py\ntorch.OutOfMemoryError: " + OOM, "torch.OutOfMemoryError: " + OOM),
    ("No available memory for the cache blocks. Try increasing `gpu_memory_utilization`",
     "RuntimeError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`"),
    ("RuntimeError: shapes do not match", None),
])
def test_engine_out_of_memory_finds_the_error_line(text, found):
    assert engine_out_of_memory(RuntimeError(text)) == (found and found[:240])


def _config(prompts_per_call=4, layout="colocated", device="cuda", deploy="single_stage"):
    return SimpleNamespace(sample=SimpleNamespace(prompts_per_step=32, prompts_per_call=prompts_per_call),
                           rollout=SimpleNamespace(engine="vllm_omni", layout=layout, device=device,
                                                   bagel_deploy=deploy, thinker_memory=0.0))


def test_the_line_names_the_engine_memory_knobs_with_their_values(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.55")
    line = cli.engine_out_of_memory(EngineOutOfMemory(OOM), _config(), tmp_path)
    assert line.startswith(f"the rollout engine ran out of memory ({OOM}); the checkpoints in {tmp_path}/checkpoints")
    assert "--config.sample.prompts_per_call=2 (now 4" in line and "XLA_CLIENT_MEM_FRACTION (now 0.55)" in line
    assert "--config.rollout.layout=split" in line and line.endswith("continue with --resume")
    assert "thinker_memory" not in line and "\n" not in line
    two_stage = cli.engine_out_of_memory(EngineOutOfMemory(OOM), _config(1, "split", deploy="two_stage"), tmp_path)
    assert "prompts_per_call is 1 already" in two_stage and "rollout.thinker_memory (" in two_stage
    assert "now 0.45" in two_stage and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in two_stage  # split: no shared GPU


def test_the_start_line_names_the_worker_log_and_the_memory_knobs(monkeypatch):
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.6")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    cause = EngineDidNotStart("the rollout engine did not start (vllm_omni on cuda): RuntimeError: Orchestrator failed")
    line = cli.engine_did_not_start(cause, _config(), "/tmp/ray/session_1/logs")
    assert line.startswith(f"{cause}; its own log is under /tmp/ray/session_1/logs (worker-*.err): look there")
    assert "XLA_CLIENT_MEM_FRACTION (now 0.6)" in line and "--config.rollout.layout=split" in line
    split = cli.engine_did_not_start(cause, _config(layout="split"), None)
    assert split == f"{cause}; its own log is in Ray's log folder (worker-*.err): look there for the worker's error"


@pytest.mark.slow
@pytest.mark.parametrize("raised, begins", [
    ("EngineDidNotStart('the rollout engine did not start (vllm_omni on cuda): RuntimeError: Orchestrator failed')",
     "error: the rollout engine did not start (vllm_omni on cuda): RuntimeError: Orchestrator failed; its own log"),
    ("RolloutDied('the rollout actor died 3 times; giving up: the last time: SIGSEGV')",
     "error: the rollout actor died 3 times; giving up: the last time: SIGSEGV; its own log"),
])
def test_a_rollout_that_did_not_start_or_died_is_one_line_exit_1(tmp_path, raised, begins):
    out = cli_run_raising(tmp_path, "from jaxflow.run.rollout_client import EngineDidNotStart, RolloutDied", raised)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(err) == 1 and "Traceback" not in out.stderr, out.stderr
    assert err[0].startswith(begins)


@pytest.mark.slow
def test_an_engine_out_of_memory_in_the_loop_is_one_line_exit_1(tmp_path):
    """From the command line (a stand-in loop raising it after start-up): one line, exit 1, no traceback."""
    out = cli_run_raising(tmp_path, "from jaxflow.run.rollout_client import EngineOutOfMemory",
                          f"EngineOutOfMemory({OOM!r})")
    err = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(err) == 1 and "Traceback" not in out.stderr, out.stderr
    assert err[0].startswith("error: the rollout engine ran out of memory (CUDA out of memory")
    assert "sample.prompts_per_call" in err[0] and "--resume" in err[0]
