"""The log-prob gate: p50 / p99 / max |trainer - rollout| log-prob per step, k steps in a row over train.logp_gate
(or the run's first step, the canary) stop the run with exit 1 and one line; a healthy run logs the figures."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxflow.trainer.logp_gate import Gate, mismatch_metrics
from tests import HANG_S
from tests.helpers import ROOT, cluster_free_env


def _metrics(p99, rows=8):
    return {"logp_mismatch_p50": p99 / 2, "logp_mismatch_p99": p99, "logp_mismatch_max": 2 * p99,
            "logp_mismatch_rows": rows}


def test_mismatch_metrics_leave_out_the_rows_not_measured():
    gaps = np.array([[1.0, 2.0, np.nan], [3.0, np.nan, 4.0]], np.float32)
    m = {k: float(v) for k, v in mismatch_metrics(gaps).items()}
    assert m == {"logp_mismatch_p50": 2.5, "logp_mismatch_p99": pytest.approx(3.97), "logp_mismatch_max": 4.0,
                 "logp_mismatch_rows": 4}


def test_k_steps_in_a_row_over_the_bound_trip_and_a_step_within_it_resets_the_count():
    gate = Gate(1e-2, 3, first_step=1)
    for step, p99 in ((1, 1e-4), (2, 0.5), (3, 0.5), (4, 1e-3), (5, 0.5), (6, 0.5)):
        gate.record(step, _metrics(p99))
        assert not gate.tripped, step
    gate.record(7, _metrics(0.5))
    assert gate.tripped
    line = str(gate.error(Path("/r"), 4))
    assert line.startswith("log-prob gate: |trainer - rollout| log-prob p99 0.5 > train.logp_gate=0.01 at 3 steps "
                           "in a row (5-7), train.logp_gate_steps=3 (p50 0.25, max 1)")
    assert "stale LoRA sync" in line and "dtype" in line and "scheduler" in line and "CFG" in line
    assert "the newest checkpoint, step 4, is as it was" in line and "\n" not in line


def test_the_first_step_is_a_canary():
    gate = Gate(1e-2, 3, first_step=11)  # a run resumed from step 10
    gate.record(11, _metrics(0.2))
    assert gate.tripped and "at step 11, the run's first (the canary)" in str(gate.error(Path("r"), 10))


@pytest.mark.parametrize("steps", [0, None])
def test_zero_or_none_turns_the_gate_off(steps):
    gate = Gate(1e-2, steps, first_step=1)
    for step in range(1, 5):
        gate.record(step, _metrics(5.0))
    assert not gate.tripped


def test_a_step_that_measured_nothing_leaves_the_count_as_it_was():
    gate = Gate(1e-2, 2, first_step=1)
    gate.record(1, _metrics(1e-5))
    gate.record(2, _metrics(0.5))
    gate.record(3, {})  # an algorithm without rollout log-probs
    gate.record(4, _metrics(float("nan"), rows=0))  # every row dropped
    assert not gate.tripped
    gate.record(5, _metrics(float("inf")))
    assert gate.tripped


def _run(tmp_path, code_prefix="", *extra):
    run_dir = tmp_path / "run"
    code = code_prefix + "import sys; from jaxflow.run import cli; from jaxflow.train import Trainer\n" \
                         "sys.exit(cli.main(Trainer))"
    args = [sys.executable, "-c", code, "--config", "configs/tiny_brightness.py", "--config.train.num_steps=2",
            f"--config.run_dir={run_dir}", "--config.rollout.layout=in_process", "--config.sample.group_size=2",
            "--config.eval.every=0", "--config.checkpoint.every=1", "--config.log.progress=False",
            "--config.log.tensorboard=False", *extra]
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S, env=cluster_free_env())
    return out, run_dir


# the trainer's SDE with 1.5x the noise level the rollout sampled with: a scheduler mismatch
MISMATCH = ("from jaxflow.algorithms import flowgrpo_step\n"
            "_prepare = flowgrpo_step.FlowGRPO.prepare\n"
            "def prepare(self, out, batch, config):\n"
            "    out = _prepare(self, out, batch, config)\n"
            "    out['noise_level'] = out['noise_level'] * 1.5\n"
            "    return out\n"
            "flowgrpo_step.FlowGRPO.prepare = prepare\n")


@pytest.mark.slow
def test_a_mismatched_scheduler_trips_the_gate_at_the_first_step(tmp_path):
    out, run_dir = _run(tmp_path, MISMATCH)
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert out.returncode == 1 and len(errors) == 1, out.stderr[-3000:]
    assert errors[0].startswith("error: log-prob gate: |trainer - rollout| log-prob p99 ")
    assert "at step 1, the run's first (the canary)" in errors[0] and "no checkpoint was written" in errors[0]
    assert "scheduler (noise_level, sde_type)" in errors[0]
    assert not (run_dir / "lora_final").exists()
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name[0].isdigit()]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["logp_mismatch_p99"] > 1e-2


@pytest.mark.slow
def test_a_healthy_run_logs_the_figures_and_does_not_trip(tmp_path):
    out, run_dir = _run(tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # float32 on both sides: rounding only, every sample and window step measured
        window = len([k for k in r if k.startswith("logp_diff_max/")])
        assert window >= 1 and r["logp_mismatch_rows"] == 8 * window
        assert 0 <= r["logp_mismatch_p50"] <= r["logp_mismatch_p99"] <= r["logp_mismatch_max"] < 1e-4
    assert (run_dir / "lora_final").exists()
