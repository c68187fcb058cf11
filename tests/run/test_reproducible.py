"""Bit-reproducible runs on the CPU with the diffusers engine: the same config and seed give the same metrics (every
value but the timings) and the same lora_final bytes; a run stopped after step 2 and resumed gives the
uninterrupted run's."""
import json
import re
import subprocess
import sys

import pytest

from tests import HANG_S
from tests.helpers import ROOT, cluster_free_env

TIMING = re.compile(r"^time$|^time/|_s$")  # wall-clock values (time, time/*, images_per_s): the only ones to differ


def _train(ray_session, run_dir, num_steps, *extra):
    """`python -m jaxflow.train` on configs/tiny_brightness.py (its rewards vary with the weights), small and fast:
    no eval, a checkpoint every step, the rollout on the tests' Ray instance."""
    address = ray_session.get_runtime_context().gcs_address
    args = [sys.executable, "-m", "jaxflow.train", "--config", str(ROOT / "configs" / "tiny_brightness.py"),
            f"--config.run_dir={run_dir}", f"--config.train.num_steps={num_steps}", "--config.eval.every=0",
            "--config.checkpoint.every=1", "--config.log.progress=False", "--config.log.tensorboard=False",
            "--config.rollout.num_cpus=0", f"--config.rollout.address={address}", *extra]
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S, env=cluster_free_env())
    assert out.returncode == 0, out.stderr[-3000:]


def _metrics(run_dir):
    """metrics.jsonl's rows by step, without the timing values."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not TIMING.search(k)} for r in rows}


def _lora_final(run_dir):
    return {p.name: p.read_bytes() for p in sorted((run_dir / "lora_final").iterdir())}


@pytest.fixture(scope="module")
def uninterrupted(ray_session, tmp_path_factory):
    """A 4-step run's run_dir."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    _train(ray_session, run_dir, 4)
    return run_dir


@pytest.mark.slow
def test_same_config_and_seed_give_identical_metrics_and_lora_bytes(ray_session, uninterrupted, tmp_path):
    _train(ray_session, tmp_path, 4)
    first, again = _metrics(uninterrupted), _metrics(tmp_path)
    assert list(first) == [1, 2, 3, 4]
    assert len({first[s]["reward_mean"] for s in first}) > 1  # rewards that vary: a real check, not constants
    for step in first:
        assert again[step] == first[step], f"step {step}: " + str(
            {k: (v, again[step].get(k)) for k, v in first[step].items() if again[step].get(k) != v})
    assert _lora_final(tmp_path) == _lora_final(uninterrupted)


@pytest.mark.slow
def test_a_run_stopped_and_resumed_gives_the_uninterrupted_runs_lora_bit_for_bit(ray_session, uninterrupted, tmp_path):
    _train(ray_session, tmp_path, 2)
    _train(ray_session, tmp_path, 4, "--resume")
    full, resumed = _metrics(uninterrupted), _metrics(tmp_path)
    assert list(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        assert resumed[step] == full[step], f"step {step}: " + str(
            {k: (v, resumed[step].get(k)) for k, v in full[step].items() if resumed[step].get(k) != v})
    assert _lora_final(tmp_path) == _lora_final(uninterrupted)
