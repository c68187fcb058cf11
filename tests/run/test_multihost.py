"""`python -m jaxflow.train` as 2 JAX processes on this machine (jax.distributed over CPU, gloo collectives):
process 0 drives the (in-process) rollout and rewards and ships each step's batch to process 1; both train their
rows of one sharded step. The run equals, bit for bit, a 1-process run of the same config over the same 2-device
mesh (2 forced host devices). (Against a 1-device run the step-0 gradients agree to float rounding, but Adam
amplifies that rounding on near-zero gradients to ~1e-4 in the LoRA after 2 steps, so that is not compared.)"""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import ROOT, cluster_free_env, final_lora
from tests import HANG_S


def _args(run_dir):
    return [sys.executable, "-m", "jaxflow.train", "--config", str(ROOT / "configs" / "tiny_ocr.py"),
            f"--config.run_dir={run_dir}", "--config.train.num_steps=2", "--config.checkpoint.every=1",
            "--config.eval.every=1000", "--config.log.progress=False", "--config.log.tensorboard=False",
            "--config.rollout.layout=in_process", f"--config.data.train={ROOT / 'data/ocr/train.txt'}",
            f"--config.data.test={ROOT / 'data/ocr/test.txt'}",
            "--config.reward.fns={'jpeg_incompressibility': 1.0}"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path):
    port = _free_port()
    procs = [subprocess.Popen(_args(tmp_path / "multi"), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=cluster_free_env(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                                              JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i),
                                                              JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo"))
             for i in range(2)]
    two_devices = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    single = subprocess.Popen(_args(tmp_path / "single"), cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=cluster_free_env(XLA_FLAGS=two_devices))
    try:
        outs = [p.communicate(timeout=HANG_S)[0] for p in procs + [single]]
    finally:
        for p in procs + [single]:
            if p.poll() is None:
                p.kill()
    for i, p in enumerate(procs + [single]):
        assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{outs[i][-3000:]}"
    run_dir = tmp_path / "multi"
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]  # steps count completed updates
    for line in lines:
        assert line["skipped"] == 0
        assert max(v for k, v in line.items() if k.startswith("logp_diff_max")) < 1e-5  # fp32 on-policy
    assert (run_dir / "checkpoints" / "2").is_dir()
    assert json.loads((run_dir / "lora_final" / "adapter_config.json").read_text())["r"] == 8
    multi, one = final_lora(run_dir), final_lora(tmp_path / "single")
    assert multi.keys() == one.keys()
    for k in one:
        np.testing.assert_allclose(multi[k], one[k], atol=1e-6, rtol=0, err_msg=k)
    single_lines = [json.loads(x) for x in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(lines, single_lines):
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6 * b["grad_norm"]
    assert not list(run_dir.glob(".process-*"))  # the shared-run_dir check leaves no marker behind


@pytest.mark.slow
def test_a_run_dir_the_processes_do_not_share_stops_both_with_one_line(tmp_path):
    """Two processes whose run_dir is not one folder (each its own, as two hosts with local disks would have):
    both exit 2 with one line naming run_dir, before any model loads; nothing is left in either folder (process 0's,
    which its run_dir lock made, is removed with it)."""
    port = _free_port()
    procs = [subprocess.Popen(_args(tmp_path / f"host{i}"), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=cluster_free_env(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                                              JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i),
                                                              JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo"))
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=HANG_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 2, f"process {i} exited {p.returncode}:\n{out[-2000:]}{err[-3000:]}"
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "is not one folder for all 2 JAX processes: process(es) [0, 1]" in errors[0], err
        assert "Traceback" not in err
    assert not (tmp_path / "host0").exists() and list((tmp_path / "host1").iterdir()) == []
