"""The run directory before any heavy work: a second run never touches the first, a resume checks its config and
says when the run is finished; a resumed metrics.jsonl holds one row per step."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxflow.run import run_dir as run_dir_lib
from jaxflow.run import run_lock
from jaxflow.config.errors import UserError
from jaxflow.run.metrics_log import RunLog
from tests.helpers import ROOT, fake_run, tiny_config
from tests import HANG_S


def snapshot(folder: Path) -> dict:
    """The run's files (the run_dir's lock file, which any run opens first, left out)."""
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != run_lock.LOCK_NAME}


def cli(*args):
    t = time.time()
    out = subprocess.run([sys.executable, "-m", "jaxflow.train", "--config", str(ROOT / "configs" / "tiny_ocr.py"),
                          "--config.reward.fns={'jpeg_incompressibility': 1.0}", *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    return out, time.time() - t


@pytest.mark.slow
def test_second_run_in_a_used_run_dir_is_refused_before_any_work(tmp_path):
    cfg = tiny_config(tmp_path)
    fake_run(tmp_path, cfg)
    before = snapshot(tmp_path)
    out, seconds = cli(f"--config.run_dir={tmp_path}")
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and all(s in lines[0] for s in ("--resume", "--config.run_dir=", "--overwrite")), lines
    assert snapshot(tmp_path) == before and seconds < 60  # nothing of the old run changed; no model, no Ray
    with pytest.raises(UserError, match="--resume"):  # the library refuses too
        run_dir_lib.check_fresh(tmp_path)


def test_overwrite_deletes_the_previous_outputs_only(tmp_path):
    cfg = tiny_config(tmp_path)
    fake_run(tmp_path, cfg)
    (tmp_path / "notes.txt").write_text("mine")
    assert run_dir_lib.preflight(cfg, resume=False, overwrite=True) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [run_lock.LOCK_NAME, "notes.txt"]
    with pytest.raises(UserError, match="pass one of them"):
        run_dir_lib.preflight(cfg, resume=True, overwrite=True)


def test_resume_refuses_a_config_that_changes_the_training(tmp_path):
    saved = tiny_config(tmp_path, num_steps=10)
    fake_run(tmp_path, saved, steps=(3, 5))
    same = tiny_config(tmp_path, num_steps=20)  # more steps, other eval/logging/placement: the same training
    same.eval.every, same.log.tensorboard, same.rollout.num_servers, same.train.num_micro_batches = 2, True, 3, 2
    assert run_dir_lib.check_resume(same) is None
    changed = tiny_config(tmp_path, num_steps=20, learning_rate=1e-3)
    changed.reward.fns = {"ocr": 1.0}
    with pytest.raises(UserError) as err:
        run_dir_lib.check_resume(changed)
    message = str(err.value)
    assert "train.learning_rate: 0.0003 -> 0.001" in message and "reward.fns.ocr: (absent) -> 1.0" in message
    assert "--allow_config_changes" in message and "eval.every" not in message
    assert run_dir_lib.check_resume(changed, allow_config_changes=True) is None


@pytest.mark.slow
def test_resume_of_a_finished_run_says_so_and_exits_0_at_once(tmp_path):
    cfg = tiny_config(tmp_path, num_steps=5)
    fake_run(tmp_path, cfg, steps=(5,))
    (tmp_path / "lora_final").mkdir()
    before = snapshot(tmp_path)
    out, seconds = cli(f"--config.run_dir={tmp_path}", "--config.train.num_steps=5", "--resume")
    assert out.returncode == 0 and "finished" in out.stdout and "num_steps" in out.stdout, out.stderr[-2000:]
    assert snapshot(tmp_path) == before and seconds < 60


def test_a_run_stopped_at_its_last_step_resumes_to_export_only(tmp_path):
    """Checkpointed at num_steps but no lora_final (stopped before the export): the resume goes on (the trainer
    then runs no step and exports); past num_steps it is refused as finished, lora_final or not."""
    cfg = tiny_config(tmp_path, num_steps=5)
    fake_run(tmp_path, cfg, steps=(5,))
    assert run_dir_lib.check_resume(cfg) is None
    with pytest.raises(UserError, match=r"step 5, past train\.num_steps=4: pass --config\.train\.num_steps=5"):
        run_dir_lib.check_resume(tiny_config(tmp_path, num_steps=4))  # no lora_final: not finished
    (tmp_path / "lora_final").mkdir()
    assert "finished" in run_dir_lib.check_resume(tiny_config(tmp_path, num_steps=4))


def test_resume_with_another_recipe_reports_the_change_before_anything_else(tmp_path):
    """A brightness run stopped at step 11 of 40, resumed with the OCR recipe (10 steps): the changed
    recipe is reported, not a "finished" run with a lora_final that does not exist."""
    stopped = tiny_config(tmp_path, num_steps=40)
    stopped.reward.fns = {"brightness": 1.0}
    fake_run(tmp_path, stopped, steps=(11,))
    with pytest.raises(UserError, match=r"reward\.fns") as e:
        run_dir_lib.check_resume(tiny_config(tmp_path, num_steps=10))
    assert "finished" not in str(e.value)


def test_nothing_to_resume_names_overwrite_not_a_circle(tmp_path):
    """Every checkpoint set aside as damaged: --resume names --overwrite (a fresh start would refuse the used
    run_dir and point back to --resume)."""
    fake_run(tmp_path, tiny_config(tmp_path), steps=(3,))
    (tmp_path / "checkpoints" / "3").rename(tmp_path / "checkpoints" / "3.damaged")
    with pytest.raises(UserError, match="--overwrite") as e:
        run_dir_lib.check_resume(tiny_config(tmp_path))
    assert "3.damaged" in str(e.value) and "start without --resume" not in str(e.value)


def test_a_resume_hides_the_replayed_steps_in_tensorboard(tmp_path):
    """The event log of a resumed run starts with a purge at the step after the checkpoint, so TensorBoard hides
    the points a fallback replays (metrics.jsonl drops their rows)."""
    from tensorboardX.proto import event_pb2
    RunLog(tmp_path, 10, 3, tensorboard=True, progress=False).close()
    events = []
    for path in (tmp_path / "tb").glob("events.*"):
        data, i = path.read_bytes(), 0
        while i < len(data):  # TFRecord: length (8), crc (4), payload, crc (4)
            n = int.from_bytes(data[i:i + 8], "little")
            events.append(event_pb2.Event.FromString(data[i + 12:i + 12 + n]))
            i += 16 + n
    starts = [e.step for e in events if e.HasField("session_log") and e.session_log.status == e.session_log.START]
    assert starts == [4]


def test_the_summary_says_how_to_view_tensorboard_without_it(tmp_path, monkeypatch):
    import importlib.util
    (tmp_path / "tb").mkdir()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    text = run_dir_lib.summary(tmp_path, 2, 2)
    assert "pip install tensorboard" in text


def test_resumed_metrics_hold_one_row_per_step(tmp_path):
    """A run killed after logging step 7 but checkpointed at 5 is resumed from 5: rows 6, 7 and a line cut by the
    kill are dropped (the resumed run logs 6 and 7 again)."""
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 8)) + '{"st')
    RunLog(tmp_path, 10, 5, tensorboard=False, progress=False).close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_an_unwritable_run_dir_is_refused_before_any_work(tmp_path):
    """A run_dir that cannot be written (here under a regular file, which stops root too): one line naming it,
    exit 2, before any model or Ray; the probe of a writable run_dir leaves nothing behind."""
    (tmp_path / "a_file").write_text("")
    run_dir = tmp_path / "a_file" / "run"
    out, _ = cli(f"--config.run_dir={run_dir}")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith(f"error: config.run_dir: {run_dir} lies under {tmp_path / 'a_file'}, a file")
    for resume in (False, True):
        with pytest.raises(UserError, match="a file, not a folder"):
            run_dir_lib.preflight(tiny_config(run_dir), resume=resume)
    run_dir_lib.check_writable(tmp_path / "new" / "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]
