"""The sign-edit data: the shipped set (data/edit_signs) is the generator's output, in the edit JSONL format."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
from PIL import Image

from experiments.mini_edit.signs import pair_arrays, split_edits, write_edits
from experiments.mini_ocr.render import HEIGHT, WIDTH
from tests import HANG_S

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "data" / "edit_signs"


def read_split(folder: Path, name: str) -> list[tuple[dict, np.ndarray]]:
    rows = [json.loads(line) for line in (folder / f"{name}.jsonl").read_text().splitlines()]
    return [(row, np.asarray(Image.open(folder / row["image"]).convert("RGB"))) for row in rows]


def test_shipped_set_equals_a_regeneration(tmp_path):
    write_edits(tmp_path)  # the defaults the shipped set was written with
    for name, count in (("train", 64), ("test", 16)):
        shipped, fresh = read_split(SHIPPED, name), read_split(tmp_path, name)
        assert len(shipped) == len(fresh) == count
        for (row, image), (row2, image2) in zip(shipped, fresh):
            assert row == row2 and np.array_equal(image, image2)
            assert set(row) == {"image", "instruction", "target"} and image.shape == (HEIGHT, WIDTH, 3)
    assert sum(p.stat().st_size for p in SHIPPED.rglob("*") if p.is_file()) < 1 << 20


def test_edits_are_deterministic_and_split_by_word():
    train, test = split_edits(64, 16, seed=0)
    assert (train, test) == split_edits(64, 16, seed=0)
    assert split_edits(64, 16, seed=1)[0] != train
    assert not {e.source for e in train} & {e.source for e in test}
    for edits in (train, test):
        words = {e.source for e in edits}
        assert all(e.target in words and e.target != e.source for e in edits)
        assert all(e.instruction == f'Replace the word "{e.source}" with "{e.target}"' for e in edits)


def test_pair_arrays_feed_source_and_edited_signs():
    edits = split_edits(4, 2)[0]
    sources, edited, instructions = pair_arrays(edits, 32, 64)
    assert sources.shape == edited.shape == (4, 32, 64, 3) and sources.dtype == np.uint8
    assert instructions == [e.instruction for e in edits]
    assert not any(np.array_equal(s, t) for s, t in zip(sources, edited))
    # an edit keeps the sign: outside the letters' columns the two renders agree
    assert np.array_equal(sources[:, :4], edited[:, :4])


def test_run_sh_data_step_writes_the_rl_data_and_the_pretraining_feed(tmp_path):
    env = {**os.environ, "SMOKE": "1", "ONLY": "data", "PYTHONPATH": str(ROOT)}
    subprocess.run(["bash", str(ROOT / "experiments/mini_edit/run.sh"), str(tmp_path)], env=env, check=True,
                   timeout=HANG_S, capture_output=True)
    rows = read_split(tmp_path / "data", "train")
    pairs = np.load(tmp_path / "data" / "pairs.npz")
    assert len(rows) == 64 and pairs["sources"].shape == pairs["edited"].shape == (64, HEIGHT, WIDTH, 3)
    for (row, image), source, instruction in zip(rows, pairs["sources"], pairs["instructions"]):
        assert np.array_equal(image, source) and row["instruction"] == instruction
    env["ONLY"] = "data pretrian"
    done = subprocess.run(["bash", str(ROOT / "experiments/mini_edit/run.sh"), str(tmp_path)], env=env,
                          timeout=HANG_S, capture_output=True, text=True)
    assert done.returncode == 2 and "unknown mini_edit step 'pretrian'" in done.stderr
