"""`python -m jaxflow.plan` (jaxflow/plan.py, jaxflow/config/machine.py): the plan block, its refusal lines, JAX's share set before JAX starts,
and the compilation cache a second process hits."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxflow import plan as plan_cli
from jaxflow.config import machine
from jaxflow.config import planner

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_ocr.py")


def test_tiny_plan_block_for_a_given_card(capsys):
    assert plan_cli.main(["plan", "--config", TINY, "--gpu-memory", "80", "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("machine: 2 x a 80 GiB card (80 GiB): layout colocated, diffusers engine, 8 sample(s) "
                          "per micro-batch per GPU, 1 micro-batch(es) an update")
    assert "no prediction: the costs were measured on a 41 GB transformer" in out


def test_auto_micro_batch_from_the_command_line(capsys, monkeypatch):
    """--config.train.num_micro_batches=auto parses (the key takes an int or 'auto') and plans the largest that fits
    (ml_collections reads the overrides from sys.argv)."""
    argv = ["plan", "--config", TINY, "--gpu-memory", "80", "--config.train.num_micro_batches=auto"]
    monkeypatch.setattr(sys, "argv", argv)
    assert plan_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "16 sample(s) per micro-batch per GPU, 1 micro-batch(es) an update" in out and "the largest that fits" in out


@pytest.mark.parametrize("args, line", [
    (["--gpus", "3", "--gpu-memory", "80"], "does not split into 1 mini-batch(es) over 3 GPU(s)"),
    (["--gpu-memory", "80", "--config.train.num_micro_batches=3"], "train.num_micro_batches"),
])
def test_refusals_are_one_line_and_exit_2(capsys, monkeypatch, args, line):
    assert plan_cli.main(["plan", "--config", TINY, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and line in err and err.count("\n") == 1


def test_no_gpu_and_no_card_memory_is_refused(capsys, monkeypatch):
    monkeypatch.setattr(machine, "local_gpus", lambda: None)
    assert plan_cli.main(["plan", "--config", TINY]) == 2
    assert "pass --gpu-memory" in capsys.readouterr().err


def _cuda_cfg():
    from jaxflow.config.validation import config_module
    cfg = config_module(ROOT / "configs" / "tiny_ocr.py").get_config()
    cfg.rollout.device = "cuda"
    return cfg


def test_jax_share_set_from_the_plan_unless_the_user_set_one(monkeypatch):
    monkeypatch.setattr(machine, "local_gpus", lambda: (planner.Card("NVIDIA H200", 140.4), 1))
    for name in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE"):
        monkeypatch.delenv(name, raising=False)
    block = machine.before_jax(_cuda_cfg())
    share = os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"]
    assert f"JAX {share} of each GPU" in block and os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.5")  # the user's: never both fraction variables
    machine.before_jax(_cuda_cfg())
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ


CACHED = """
import json, sys, jax, jax.numpy as jnp
from jaxflow.config.machine import compilation_cache
hits = []
jax.monitoring.register_event_listener(lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else None)
print(json.dumps({"dir": str(compilation_cache(True)), "hits": len(hits) if jax.jit(lambda x: jnp.sin(x) @ x.T)(
    jnp.ones((64, 64))).block_until_ready() is not None else 0}))
"""


def test_second_process_hits_the_compilation_cache(tmp_path):
    """Even a compile of milliseconds (below JAX's default threshold of 1 s) is stored: a warm start compiles none
    of the start's small programs again."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")}
    env.update(JAXFLOW_CACHE=str(tmp_path), PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    runs = [json.loads(subprocess.run([sys.executable, "-c", CACHED], env=env, capture_output=True, text=True,
                                      check=True, timeout=900).stdout.strip().splitlines()[-1]) for _ in range(2)]
    assert runs[0]["dir"] == str(tmp_path / "xla") and any((tmp_path / "xla").iterdir())
    assert runs[0]["hits"] == 0 and runs[1]["hits"] >= 1
