"""A damaged newest checkpoint: resume falls back to the newest one that restores, naming the one skipped and why;
one line when none restores."""
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxflow.trainer.checkpoint import Checkpointer
from jaxflow.config.errors import UserError
from tests.helpers import ROOT, STATE, fake_run, tiny_config
from tests import HANG_S


def _corrupt(step_dir: Path) -> None:
    """Flip the bytes of the largest array data file (zstd-compressed, so TensorStore detects it)."""
    data = max((p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[64:-64] = bytes(b ^ 0x5A for b in raw[64:-64])
    data.write_bytes(bytes(raw))


def test_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path, caplog):
    ckpt = fake_run(tmp_path, tiny_config(tmp_path), steps=(3, 5))
    _corrupt(tmp_path / "checkpoints" / "5")
    state, meta = ckpt.restore(STATE)
    assert meta["step"] == 3 and float(state["a"][1]) == 3.0
    assert "checkpoint 5 does not restore" in caplog.text and "ZSTD" in caplog.text
    assert (tmp_path / "checkpoints" / "5.damaged").is_dir()  # kept for inspection, out of orbax's way
    ckpt.save(5, STATE, {"step": 5})  # the resumed run can checkpoint step 5 again
    np.testing.assert_array_equal(ckpt.restore(STATE)[0]["b"], STATE["b"])


def test_a_save_cut_short_is_removed_without_warnings(tmp_path, caplog):
    """A process killed mid-save leaves `<step>.orbax-checkpoint-tmp`: the next Checkpointer removes it, and saving
    that step again prints nothing (was orbax's warning about removing a directory "not finalized")."""
    ckpt = fake_run(tmp_path, tiny_config(tmp_path), steps=(3,))
    shutil.copytree(tmp_path / "checkpoints" / "3", tmp_path / "checkpoints" / "5.orbax-checkpoint-tmp")
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=3)
    ckpt.save(5, STATE, {"step": 5})
    assert not [r for r in caplog.records if r.levelno >= 30], caplog.text
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["3", "5"]


@pytest.mark.slow
def test_killed_run_leaves_no_process_and_resumes_with_one_line(tmp_path):
    """kill -9 of a trainer: every process it started (Ray's included) ends within seconds, not after the raylet
    agents' 60 s report to the dead GCS. Then its newest checkpoint's OCDBT manifest is damaged and the save after it
    left cut short: the resume sets the damaged one aside, finishes from the one before and prints only the warning
    naming it (was hundreds of asyncio traceback lines from the reads orbax abandons, and orbax's "not finalized")."""
    import time

    import psutil

    args = [sys.executable, "-m", "jaxflow.train", "--config", str(ROOT / "configs" / "tiny_brightness.py"),
            f"--config.run_dir={tmp_path}", "--config.checkpoint.every=1", "--config.eval.every=1000",
            "--config.rollout.num_cpus=0"]
    ckpts = tmp_path / "checkpoints"
    trainer = subprocess.Popen(args + ["--config.train.num_steps=50"], cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    bound = time.monotonic() + HANG_S
    while len([p for p in ckpts.glob("*") if p.name.isdigit()]) < 2 and time.monotonic() < bound:
        assert trainer.poll() is None, "the trainer ended before its second checkpoint"
        time.sleep(0.5)
    started = psutil.Process(trainer.pid).children(recursive=True)
    assert any("raylet" in " ".join(p.cmdline()) for p in started)
    trainer.kill()
    trainer.wait()
    killed = time.monotonic()
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in started) and time.monotonic() < bound:
        time.sleep(0.5)
    outlived = time.monotonic() - killed
    assert outlived < 45, f"the trainer's processes outlived it by {outlived:.0f} s"  # vs Ray's fixed 60 s timeout

    newest = max(int(p.name) for p in ckpts.glob("*") if p.name.isdigit())
    manifest = ckpts / str(newest) / "state" / "manifest.ocdbt"
    raw = manifest.read_bytes()
    manifest.write_bytes(raw[:8] + bytes(b ^ 0x5A for b in raw[8:]))
    cut = ckpts / f"{newest + 1}.orbax-checkpoint-tmp"  # a save cut short, if the kill did not leave one
    if not cut.exists():
        shutil.copytree(ckpts / str(newest - 1), cut)
    out = subprocess.run(args + [f"--config.train.num_steps={newest + 1}", "--resume"], cwd=ROOT,
                         capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()  # the killed run's lock taken over, then the damaged checkpoint
    assert len(lines) == 2, out.stderr[-3000:]
    assert f"taking over the lock of a run that ended without releasing it (killed?): pid {trainer.pid}" in lines[0]
    assert f"checkpoint {newest} does not restore" in lines[1], out.stderr[-3000:]
    assert f"{newest}.damaged" in {p.name for p in ckpts.iterdir()}
    assert not list(ckpts.glob("*.orbax-checkpoint-tmp"))


def test_no_checkpoint_restores_is_one_line(tmp_path):
    ckpt = fake_run(tmp_path, tiny_config(tmp_path), steps=(3, 5))
    for step in (3, 5):
        _corrupt(tmp_path / "checkpoints" / str(step))
    with pytest.raises(UserError, match=r"no checkpoint in .* restores \(5: .*ZSTD.*; 3: .*\): start the run again with --overwrite") as e:
        ckpt.restore(STATE)
    assert "\n" not in str(e.value)


def test_bytes_changed_after_the_save_are_caught_by_the_checksums(tmp_path, caplog):
    """16 bytes overwritten inside stored array data that still decompresses (once trained on silently, every
    update skipped): the leaf's crc32 differs, so the checkpoint is set aside like any damaged one."""
    ckpt = fake_run(tmp_path, tiny_config(tmp_path), steps=(3, 5))
    data = max((p for p in (tmp_path / "checkpoints" / "5").rglob("*") if p.is_file() and p.parent.name == "d"),
               key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[200:216] = b"\xff" * 16
    data.write_bytes(bytes(raw))
    state, meta = ckpt.restore(STATE)
    assert meta["step"] == 3 and "reads back with another checksum" in caplog.text
    assert (tmp_path / "checkpoints" / "5.damaged").is_dir()


@pytest.mark.slow
def test_a_run_whose_every_update_is_skipped_exits_1_with_one_line(tmp_path):
    """A checkpoint whose LoRA makes every forward non-finite (saved that way, so its checksums match: here one
    update at lr 1e30): the resumed run skips every update and ends with exit 1 and one line, not "finished" and 0;
    the skipped steps write no checkpoint."""
    import json
    import subprocess
    import sys

    args = [sys.executable, "-m", "jaxflow.train", f"--config.run_dir={tmp_path}", "--config.rollout.layout=in_process",
            "--config.reward.fns={'jpeg_incompressibility': 1.0}", "--config.log.progress=False",
            "--config.eval.every=1000", "--config.train.learning_rate=1e30"]
    first = subprocess.run(args + ["--config.train.num_steps=1"], cwd=ROOT, capture_output=True, text=True,
                           timeout=HANG_S)
    assert first.returncode == 0, first.stderr[-2000:]
    out = subprocess.run(args + ["--config.train.num_steps=3", "--resume"], cwd=ROOT, capture_output=True, text=True,
                         timeout=HANG_S)
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
    assert out.returncode == 1 and len(errors) == 1 and "ended on steps 2-3" in errors[0], out.stderr[-2000:]
    assert "no lora_final is written and the newest checkpoint, step 1, is as it was" in errors[0]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["1"]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in rows] == [0, 1, 1]


TENSORSTORE_FULL = ("RESOURCE_EXHAUSTED: Error writing \"00003/0.0.0\" in OCDBT database: Failed to write 163372 bytes "
                    "to file 52: No space left on device [os_error_code='28']")


def test_a_full_disk_while_checkpointing_is_one_line_and_the_checkpoints_stay(tmp_path, monkeypatch, caplog):
    """The disk fills during a save (TensorStore's error, raised through the public `manager`): Checkpointer.save
    raises one ENOSPC OSError naming the folder (orbax's thread logs dropped, the unfinished folder removed), the
    command line's line names it, the space left and the newest intact checkpoint, also when closing TensorBoard
    then fails too; the earlier checkpoint still restores."""
    import errno
    import logging

    from jaxflow.run import cli
    ckpt = fake_run(tmp_path, tiny_config(tmp_path), steps=(3,))

    def full(step, **_):
        (tmp_path / "checkpoints" / f"{step}.orbax-checkpoint-tmp").mkdir()
        logging.getLogger("absl").error("_SignalingThread.run() raised an exception: %s", TENSORSTORE_FULL)
        raise ValueError(TENSORSTORE_FULL)
    monkeypatch.setattr(ckpt.manager, "save", full)
    with pytest.raises(OSError) as e:
        try:
            ckpt.save(5, STATE, {"step": 5})
        finally:  # the run's logs close after it and fail on the same full disk
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "tb" / "events.out"))
    saved = e.value.__context__
    assert saved.errno == errno.ENOSPC and saved.filename == str(tmp_path / "checkpoints")
    assert "No space left" not in caplog.text
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["3"]
    line = cli.disk_full(e.value, tmp_path)
    assert line.startswith(f"no space left on device for checkpoint 5 in {tmp_path / 'checkpoints'} (") and \
        " free there); the checkpoints in " in line and "(newest: step 3): free space, then continue with --resume" \
        in line and "\n" not in line, line
    assert cli.disk_full(ValueError("RESOURCE_EXHAUSTED: out of memory"), tmp_path) is None
    assert ckpt.restore(STATE)[1]["step"] == 3


def test_a_fallback_silences_the_reads_it_abandons(tmp_path, caplog):
    """After a fallback, a future of an abandoned read that failed and is collected unread logs nothing (asyncio
    names it "Future exception was never retrieved", or "Task ..." for a task); other asyncio errors still log."""
    import asyncio
    import gc
    import logging

    ckpt = fake_run(tmp_path, tiny_config(tmp_path), steps=(3, 5))
    _corrupt(tmp_path / "checkpoints" / "5")
    ckpt.restore(STATE)
    loop = asyncio.new_event_loop()
    future = loop.create_future()
    future.set_exception(ValueError("DATA_LOSS"))
    caplog.clear()
    del future
    gc.collect()
    logging.getLogger("asyncio").error("another asyncio error")
    loop.close()
    assert "never retrieved" not in caplog.text and "another asyncio error" in caplog.text
