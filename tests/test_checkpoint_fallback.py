"""A damaged newest checkpoint: resume falls back to the newest one that restores, naming the one skipped and why;
one line when none restores."""
from pathlib import Path

import numpy as np
import pytest

from jaxflow.config import UserError
from tests.helpers import ROOT, STATE, fake_run, tiny_config


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
                           timeout=900)
    assert first.returncode == 0, first.stderr[-2000:]
    out = subprocess.run(args + ["--config.train.num_steps=3", "--resume"], cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
    assert out.returncode == 1 and len(errors) == 1 and "ended on steps 2-3" in errors[0], out.stderr[-2000:]
    assert "no lora_final is written and the newest checkpoint, step 1, is as it was" in errors[0]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["1"]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in rows] == [0, 1, 1]
