"""Engine faults through the rollout client and the Ray server: an engine out of memory (torch's CUDA OOM, raised
by a stand-in engine on the CPU) ends the call at once as `EngineOutOfMemory`, never restarted and retried; the
command line turns it into one line naming the engine's memory knobs."""
from types import SimpleNamespace

import numpy as np
import pytest

from jaxflow.run import cli
from jaxflow.run.rollout_client import EngineOutOfMemory, RayTransport, RolloutGroup, engine_out_of_memory
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


class CountingTransport(RayTransport):
    """RayTransport starting `OomServer` actors, counting the starts (a restart starts fresh ones)."""

    starts = 0

    def start(self, config: dict):
        import ray
        self.starts += 1
        return ray.remote(OomServer).options(num_cpus=0).remote(config)


def _group(fail_in: str):
    transport = CountingTransport(num_cpus=0, max_retries=2)
    return RolloutGroup({"fail_in": fail_in}, 1, transport), transport


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
    assert "--config.sample.prompts_per_call=2 (now 4" in line and "XLA_PYTHON_CLIENT_MEM_FRACTION (now 0.55)" in line
    assert "--config.rollout.layout=split" in line and line.endswith("continue with --resume")
    assert "thinker_memory" not in line and "\n" not in line
    two_stage = cli.engine_out_of_memory(EngineOutOfMemory(OOM), _config(1, "split", deploy="two_stage"), tmp_path)
    assert "prompts_per_call is 1 already" in two_stage and "rollout.thinker_memory (" in two_stage
    assert "now 0.45" in two_stage and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in two_stage  # split: no shared GPU


@pytest.mark.slow
def test_an_engine_out_of_memory_in_the_loop_is_one_line_exit_1(tmp_path):
    """From the command line (a stand-in loop raising it after start-up): one line, exit 1, no traceback."""
    out = cli_run_raising(tmp_path, "from jaxflow.run.rollout_client import EngineOutOfMemory",
                          f"EngineOutOfMemory({OOM!r})")
    err = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(err) == 1 and "Traceback" not in out.stderr, out.stderr
    assert err[0].startswith("error: the rollout engine ran out of memory (CUDA out of memory")
    assert "sample.prompts_per_call" in err[0] and "--resume" in err[0]
