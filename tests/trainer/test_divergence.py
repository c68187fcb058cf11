"""A diverged run stops: steps with a skipped update are counted in a row (`SkipStreak`), write no checkpoint, and
more than train.max_skipped_steps of them end the run with exit 1, one line and no lora_final."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxflow.run import run_dir as run_dir_lib
from jaxflow.trainer.divergence import Diverged, SkipStreak, check_finite
from tests.helpers import ROOT, cluster_free_env
from tests import HANG_S


def test_the_streak_counts_steps_in_a_row_and_a_clean_step_ends_it():
    skips = SkipStreak(2)
    for step, skipped in ((1, True), (2, False), (3, True), (4, True)):
        skips.record(step, skipped)
    assert skips.length == 2 and not skips.over
    skips.record(5, True)
    assert skips.over
    message = str(skips.error(Path("/r"), 2, ended=False))
    assert message.startswith("steps 3-5 skipped updates, 3 in a row, more than train.max_skipped_steps=2")
    assert "the newest checkpoint, step 2, is as it was" in message and "/r/metrics.jsonl" in message
    skips.record(6, False)
    assert skips.length == 0 and not skips.over


def test_zero_allows_no_skipped_step():
    skips = SkipStreak(0)
    skips.record(1, True)
    assert skips.over and "no checkpoint was written" in str(skips.error(Path("r"), None, ended=False))


def test_a_streak_from_the_first_update_is_not_called_a_divergence():
    """The policy had not moved when the first update's loss was not finite: the batch and the numerics come first,
    the learning rate after them."""
    skips = SkipStreak(2)
    for step in (1, 2, 3):
        skips.record(step, True)
    message = str(skips.error(Path("/r"), None, ended=True))
    assert message.startswith("the run ended on steps 1-3, whose updates were skipped (a non-finite loss, gradient "
                              "or updated LoRA) from the run's first update on, when the policy had not moved")
    assert "the policy diverged" not in message and "lower train.learning_rate" not in message
    assert "the batch (rewards, advantages)" in message and "/r/metrics.jsonl" in message
    skips.record(4, False)
    skips.record(5, True)  # a streak after an update that moved the policy
    assert "the policy diverged" in str(skips.error(Path("/r"), 4, ended=True))


def test_a_lora_with_a_non_finite_value_is_not_exported():
    lora = {"a": np.ones((2, 3), np.float32), "b": np.array([1.0, np.inf, np.nan], np.float32)}
    with pytest.raises(Diverged, match=r"^the trained lora holds 2 non-finite values, so out/lora_final is not "):
        check_finite(lora, "the trained lora", Path("out/lora_final"))
    check_finite({"a": lora["a"]}, "the trained lora", Path("out/lora_final"))


def test_the_closing_summary_names_the_steps_that_skipped_an_update(tmp_path):
    assert len(run_dir_lib.summary(tmp_path, 5, 5).splitlines()) == 1  # no outputs, nothing skipped
    lines = run_dir_lib.summary(tmp_path, 5, 5, skipped=[2, 4]).splitlines()
    assert lines[1].startswith("  skipped      an update at 2 step(s) (2, 4): a non-finite loss, gradient or LoRA")


@pytest.mark.slow
def test_a_runaway_learning_rate_stops_the_run_with_exit_1(tmp_path):
    """lr 1e30: the first update blows the LoRA up (its values stay finite), every later loss is non-finite. Steps 2-5
    skip their updates, 4 in a row > the default train.max_skipped_steps=3: the run stops after step 5 with one
    error line, exit 1, no lora_final, and only the checkpoint of step 1 (written before the skips began)."""
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "jaxflow.train", "--config", "configs/tiny_brightness.py",
            "--config.train.learning_rate=1e30", "--config.train.num_steps=6", f"--config.run_dir={run_dir}",
            "--config.rollout.layout=in_process", "--config.sample.group_size=2", "--config.eval.every=0",
            "--config.checkpoint.every=1", "--config.log.progress=False", "--config.log.tensorboard=False"]
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S, env=cluster_free_env())
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert out.returncode == 1 and len(errors) == 1, out.stderr[-3000:]
    assert "steps 2-5 skipped updates, 4 in a row, more than train.max_skipped_steps=3" in errors[0]
    assert "the newest checkpoint, step 1, is as it was" in errors[0]
    assert not (run_dir / "lora_final").exists()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name[0].isdigit()) == ["1"]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in rows] == [0, 1, 1, 1, 1]
