"""JAX's pool checked against the share of the GPU the plan gave it (jaxflow/train.py `check_share`,
jaxflow/trainer/memory.py): a JAX that started before `before_jax` set XLA_PYTHON_CLIENT_MEM_FRACTION holds its
default 75% and the engine beside it has no room, so the trainer stops in its checks with one line, before any
engine is launched; a pool of the planned share, or a share the user set, passes. The GPU (nvidia-smi) and JAX's
pool statistics are stand-ins: on a GPU, bytes_limit is floor(fraction x CUDA's total)."""
import dataclasses
import os
import subprocess
import sys

import pytest

from jaxflow import train
from jaxflow.config import machine, planner
from jaxflow.trainer import memory
from tests import HANG_S
from tests.helpers import ROOT, tiny_config

MIB = 2 ** 20
H200_MIB = 143771  # nvidia-smi's memory.total of an H200
CUDA_TOTAL = (H200_MIB - 480) * MIB  # CUDA's total leaves out what the driver reserves
FRACTIONS = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE")


class Device:
    """A GPU as JAX reports its pool."""

    def __init__(self, bytes_limit):
        self.bytes_limit = bytes_limit

    def memory_stats(self):
        return {"bytes_limit": self.bytes_limit, "bytes_in_use": 0}


@pytest.fixture
def h200(monkeypatch):
    """One H200 as nvidia-smi reports it, its plan giving JAX 0.56 as the full-size model's on it (the tiny model's
    leaves the engine less), no fraction variable set; afterwards no share is kept."""
    monkeypatch.setattr(machine, "local_gpus", lambda: (planner.Card("NVIDIA H200", H200_MIB / 1024), 1))
    plan = machine.machine_plan
    monkeypatch.setattr(machine, "machine_plan", lambda cfg: dataclasses.replace(plan(cfg), jax_share=0.56))
    for name in FRACTIONS:
        monkeypatch.delenv(name, raising=False)
    yield
    machine.before_jax(tiny_config("unused"))  # a CPU rollout: no share kept for the tests after


def _plan(tmp_path, layout="colocated"):
    """The tiny config with `layout`, after `before_jax` planned it for the GPU: the share it set."""
    cfg = tiny_config(tmp_path / "run")
    cfg.rollout.layout = layout
    gpu = tiny_config(tmp_path / "run")
    gpu.rollout.device = "cuda"
    machine.before_jax(gpu)
    return cfg


def _default_pool():
    return int(0.75 * CUDA_TOTAL)  # JAX's default share, taken when it starts before its share is set


def test_a_pool_larger_than_planned_stops_the_trainer_in_its_checks(tmp_path, h200, monkeypatch):
    cfg = _plan(tmp_path)
    share = machine.share_set()
    assert share == machine.JaxShare(0.56, H200_MIB * MIB)
    launched = []
    monkeypatch.setattr(memory, "pool", lambda device=None: (_default_pool(), 0))
    monkeypatch.setattr(train, "Driver", lambda *a, **k: launched.append("driver"))
    monkeypatch.setattr(train, "Learner", lambda *a, **k: launched.append("learner"))
    with pytest.raises(memory.PoolLargerThanPlanned) as e:
        train.Trainer(cfg)
    line = str(e.value)
    assert "\n" not in line and not launched and not (tmp_path / "run").exists()
    assert line.startswith(f"JAX holds {_default_pool() / 2 ** 30:.1f} GiB of GPU 0 where the plan gave it "
                           f"{share.fraction * share.card_bytes / 2 ** 30:.1f} GiB ({share.fraction:g})")
    assert "the colocated engine has no room" in line
    assert f"Set XLA_CLIENT_MEM_FRACTION={share.fraction:g}" in line


@pytest.mark.parametrize("layout", ["colocated", "in_process"])
def test_the_planned_pool_passes_with_xlas_rounding(tmp_path, h200, layout):
    """XLA's pool of the planned fraction: floor(fraction x CUDA's total), below the plan's fraction x nvidia-smi's
    total; nvidia-smi floors its total to whole MiB, so a CUDA total up to one MiB above it passes too, and so does a
    pool just within the margin; one just beyond it stops."""
    cfg = _plan(tmp_path, layout)
    fraction = machine.share_set().fraction
    train.check_share(cfg, [Device(int(fraction * CUDA_TOTAL)), Device(int(fraction * (H200_MIB + 1) * MIB) - 1)])
    margin = int(memory.POOL_MARGIN * H200_MIB * MIB)
    train.check_share(cfg, [Device(int(fraction * H200_MIB * MIB) + margin)])
    with pytest.raises(memory.PoolLargerThanPlanned, match="GPU 0 where"):
        train.check_share(cfg, [Device(int(fraction * H200_MIB * MIB) + margin + MIB)])
    with pytest.raises(memory.PoolLargerThanPlanned, match="GPU 1 where"):  # the check reads every device
        train.check_share(cfg, [Device(int(fraction * CUDA_TOTAL)), Device(_default_pool())])


def test_a_share_the_user_set_is_theirs(tmp_path, h200, monkeypatch):
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.75")
    cfg = _plan(tmp_path)
    assert machine.share_set() is None
    train.check_share(cfg, [Device(_default_pool())])


def test_nothing_where_no_engine_shares_the_gpu_or_no_pool_is_reported(tmp_path, h200):
    train.check_share(_plan(tmp_path, "split"), [Device(_default_pool())])  # engines on GPUs of their own
    train.check_share(_plan(tmp_path), [type("Cpu", (), {"memory_stats": lambda self: None})()])


@pytest.mark.slow
def test_the_command_line_exits_1_with_the_one_line(tmp_path):
    """The command line (a process of its own): a fake H200 planned with rollout.device=cuda (JAX 0.56), JAX's
    backend check let through and its pool the default 75%: exit 1, the one line on stderr, nothing written."""
    run_dir = tmp_path / "run"
    code = ("import sys; from jaxflow.run import cli; from jaxflow import train; "
            "from jaxflow.config import machine, planner; from jaxflow.trainer import memory; "
            f"machine.local_gpus = lambda: (planner.Card('NVIDIA H200', {H200_MIB} / 1024), 1); "
            "import dataclasses; plan = machine.machine_plan; "
            "machine.machine_plan = lambda cfg: dataclasses.replace(plan(cfg), jax_share=0.56); "
            f"memory.pool = lambda device=None: ({_default_pool()}, 0); "
            "train.check_backend = lambda cfg: None; "
            "sys.exit(cli.main(train.Trainer))")
    env = {k: v for k, v in os.environ.items() if k not in FRACTIONS}
    out = subprocess.run([sys.executable, "-c", code, f"--config.run_dir={run_dir}", "--config.rollout.device=cuda",
                          "--config.rollout.layout=colocated", "--config.log.progress=False"],
                         cwd=ROOT, capture_output=True, text=True, timeout=HANG_S, env={**env, "JAX_PLATFORMS": "cpu"})
    err = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(err) == 1 and err[0].startswith("error: JAX holds "), (out.returncode, err)
    assert not run_dir.exists()
