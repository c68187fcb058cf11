"""Gold rewards (jaxflow/run/gold.py): the best eval and the early-stop rule, lora_best's swap, the config's checks;
and a whole tiny run that hacks brightness, keeps its best adapter and stops early with one line (slow)."""
import json
import subprocess
import sys

import numpy as np
import pytest

from jaxflow.config import validation as config_lib
from jaxflow.run.gold import BEST_FILE, GoldWatch, publish, staging
from tests import HANG_S
from tests.helpers import ROOT, tiny_config


def feed(watch, evals):
    """(best steps, the step whose eval stopped the run or None) of `evals`: [(gold, train), ...] at steps 1, 2, ..."""
    best, stop = [], None
    for step, (g, t) in enumerate(evals, 1):
        verdict = watch.record(step, g, t)
        if verdict.best:
            best.append(step)
        if verdict.stop and stop is None:
            stop = step
    return best, stop


def test_best_is_the_highest_gold_so_far_not_the_newest_nor_the_training_rewards():
    watch = GoldWatch("midtone")
    best, stop = feed(watch, [(0.5, 0.1), (0.7, 0.2), (0.6, 0.9), (0.7, 0.95), (0.8, 0.1)])
    assert best == [1, 2, 5] and stop is None  # a tie (step 4) is no new best; stop_after 0 never stops
    assert watch.note() == {"step": 5, "metric": "midtone", "value": 0.8}


def test_stop_needs_n_consecutive_falls_of_gold_each_while_training_rises():
    # gold falls at every step but the training reward rises only at steps 2 and 4: never two in a row
    assert feed(GoldWatch("g", 2), [(0.9, 0.1), (0.8, 0.2), (0.7, 0.1), (0.6, 0.3), (0.5, 0.2)]) == ([1], None)
    # a gold that rises in between restarts it too
    assert feed(GoldWatch("g", 2), [(0.9, 0.1), (0.8, 0.2), (0.85, 0.3), (0.7, 0.4)]) == ([1], None)
    # two falls in a row while it rises: stops at the second
    assert feed(GoldWatch("g", 2), [(0.5, 0.1), (0.9, 0.2), (0.8, 0.3), (0.7, 0.4), (0.6, 0.5)]) == ([1, 2], 4)
    assert feed(GoldWatch("g", 1), [(0.5, 0.1), (0.4, 0.2)]) == ([1], 2)


def test_stop_line_names_the_metric_the_rule_and_the_kept_step():
    watch = GoldWatch("midtone", 1)
    watch.record(3, 0.6, 0.5)
    line = watch.record(4, 0.5, 0.6).stop
    assert "eval_gold/midtone fell at 1 evals in a row while eval_reward_mean rose" in line
    assert "stopped after step 4" in line and "lora_best holds step 3 (eval_gold/midtone 0.6000)" in line


def test_a_resumed_watch_knows_the_best_that_lora_best_holds(tmp_path):
    folder = tmp_path / "lora_best"
    assert GoldWatch.resume("midtone", 2, folder).best_value is None
    tmp = staging(folder)
    tmp.mkdir()
    publish(tmp, folder, {"step": 7, "metric": "midtone", "value": 0.4})
    watch = GoldWatch.resume("midtone", 2, folder)
    assert (watch.best_step, watch.best_value, watch.stop_after) == (7, 0.4, 2)
    assert not watch.record(8, 0.3, 1.0).best and watch.record(9, 0.5, 1.0).best
    assert GoldWatch.resume("other", 0, folder).best_value is None  # another metric's best is no best of this one


def test_publish_swaps_a_whole_folder_in_and_leaves_nothing_beside_it(tmp_path):
    dest = tmp_path / "lora_best"
    for step in (1, 2):
        tmp = staging(dest)
        tmp.mkdir()
        (tmp / "adapter_model.safetensors").write_text(f"adapter {step}")
        publish(tmp, dest, {"step": step})
        assert (dest / "adapter_model.safetensors").read_text() == f"adapter {step}"
        assert json.loads((dest / BEST_FILE).read_text()) == {"step": step}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora_best"]
    half = staging(dest)  # an export cut short left a partial folder: the next one starts clean
    half.mkdir()
    (half / "junk").write_text("x")
    assert not staging(dest).exists()


@pytest.mark.parametrize("key, value, needle", [
    ("rewards", {"sharpness": 1.0}, "config.eval.rewards: unknown ['sharpness']"),
    ("best_metric", "midtone", "config.eval.best_metric: 'midtone' is not a gold reward"),
    ("stop_after", -1, "config.eval.stop_after: must be an int >= 0"),
    ("stop_after", 2, "config.eval.stop_after: watches eval.best_metric"),
])
def test_gold_config_errors_name_the_fix(tmp_path, key, value, needle):
    cfg = tiny_config(tmp_path)
    cfg.eval[key] = value
    with pytest.raises(ValueError, match=needle.replace(".", r"\.").replace("[", r"\[").replace("]", r"\]")):
        config_lib.validate(cfg)


def test_best_metric_without_evals_is_valid(tmp_path):
    """configs/tiny_brightness.py names a best_metric; its runs with eval.every=0 (no evals, no lora_best) stay valid."""
    cfg = tiny_config(tmp_path)
    cfg.eval.update(rewards={"midtone": 1.0}, best_metric="midtone", stop_after=2, every=0)
    config_lib.validate(cfg)


@pytest.mark.slow
def test_a_brightness_hacking_run_keeps_its_best_adapter_and_stops_early(tmp_path):
    """Brightness trained, midtone (which brightness ruins) watched: the run stops with one line, exit 0, its
    lora_best the adapter of the best midtone eval, its checkpoint and lora_final those of the step it stopped at."""
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "jaxflow.train", "--config", str(ROOT / "configs" / "tiny_brightness.py"),
            f"--config.run_dir={run_dir}", "--config.log.progress=False", "--config.log.tensorboard=False",
            "--config.rollout.layout=in_process", "--config.train.num_steps=12", "--config.eval.every=1",
            "--config.checkpoint.every=1", "--config.checkpoint.keep=12", "--config.eval.stop_after=2",
            "--config.train.learning_rate=3e-2"]  # brightness rises within a few steps
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [x for x in out.stdout.splitlines() if x.startswith("stopped early: ")]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    gold = [r["eval_gold/midtone"] for r in rows]
    train = [r["eval_reward_mean"] for r in rows]
    stopped = rows[-1]["step"]
    assert len(lines) == 1 and f"stopped after step {stopped};" in lines[0], out.stdout[-3000:]
    assert stopped < 12 and all("eval_reward/brightness" in r for r in rows)
    assert all(gold[i] < gold[i - 1] and train[i] > train[i - 1] for i in (-1, -2))  # the rule held at the stop
    best_step = rows[int(np.argmax(gold))]["step"]
    note = json.loads((run_dir / "lora_best" / BEST_FILE).read_text())
    assert note == {"step": best_step, "metric": "midtone", "value": max(gold)}
    assert f"lora_best holds step {best_step} " in lines[0]
    assert (run_dir / "lora_best" / "adapter_model.safetensors").is_file()
    assert not any(p.name.startswith("lora_best.") for p in run_dir.iterdir())  # no partial or old folder left
    assert (run_dir / "lora_final").is_dir() and (run_dir / "checkpoints" / str(stopped)).is_dir()
    if best_step != stopped:  # lora_best is the best eval's adapter, not the last one
        best = (run_dir / "lora_best" / "adapter_model.safetensors").read_bytes()
        assert best != (run_dir / "lora_final" / "adapter_model.safetensors").read_bytes()
