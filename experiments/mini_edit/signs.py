"""Sign-edit data: a sign reading word A (experiments/mini_ocr's renderer and pseudo-words), the instruction
`Replace the word "A" with "B"` and the target text B; the edited sign is the same render with B in place of A.

The edit data format (one JSON object a line, what `jaxflow/run/data.py` reads for an edit family):
``{"image": path relative to the .jsonl, "instruction": str, "target": str}`` ("target" optional; the edit
rewards that score text need it). Train and test use disjoint word sets (mini_ocr's split); each example's B is
another word of its split and each sign is shifted by a few pixels (mini_ocr's `jitter`), both pure functions of
(count, seed), so a regeneration is identical.

CLI: ``python -m experiments.mini_edit.signs --out DIR [--train 64 --test 16 --seed 0 --height 64 --width 128]
[--pairs]`` writes DIR/{train,test}.jsonl and DIR/images/{train,test}_NNN.png; with --pairs also the pretraining
feed DIR/pairs.npz (the train split's source and edited signs, uint8, and instructions). The shipped set,
data/edit_signs, is the defaults' output: ``python -m experiments.mini_edit.signs --out data/edit_signs``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
from PIL import Image

from experiments.mini_ocr.render import HEIGHT, WIDTH, jitter, render
from experiments.mini_ocr.words import split

INSTRUCTION = 'Replace the word "{}" with "{}"'
MAX_SHIFT = 3


@dataclasses.dataclass(frozen=True)
class SignEdit:
    """One edit: the sign's word, the word to write instead, and the pixel shift (dx, dy) of both renders."""
    source: str
    target: str
    shift: tuple[int, int]

    @property
    def instruction(self) -> str:
        return INSTRUCTION.format(self.source, self.target)

    def images(self, height: int = HEIGHT, width: int = WIDTH) -> tuple[np.ndarray, np.ndarray]:
        """(source sign, correctly edited sign), each (height, width, 3) uint8."""
        return (render(self.source, height, width, self.shift), render(self.target, height, width, self.shift))


def make_edits(words: list[str], seed: int, stream: int) -> list[SignEdit]:
    """One edit per word: its target another word of `words`, its shift seeded by (seed, stream, index)."""
    rng = np.random.default_rng([seed, stream])
    edits = []
    for i, word in enumerate(words):
        j = int(rng.integers(len(words) - 1))
        edits.append(SignEdit(word, words[j + (j >= i)], jitter(seed + stream, i, 1, MAX_SHIFT)))
    return edits


def split_edits(num_train: int, num_test: int, seed: int = 0) -> tuple[list[SignEdit], list[SignEdit]]:
    """(train, test) edits over mini_ocr's disjoint word split."""
    train, test = split(num_train, num_test, seed)
    return make_edits(train, seed, 0), make_edits(test, seed, 1)


def pair_arrays(edits: list[SignEdit], height: int = HEIGHT, width: int = WIDTH
                ) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """The pretraining feed: (sources (N, H, W, 3) uint8, edited (N, H, W, 3) uint8, instructions)."""
    pairs = [e.images(height, width) for e in edits]
    return (np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs]), [e.instruction for e in edits])


def write_split(out: Path, name: str, edits: list[SignEdit], height: int, width: int) -> Path:
    """DIR/images/<name>_NNN.png (the source signs) and DIR/<name>.jsonl."""
    (out / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i, edit in enumerate(edits):
        image = Path("images") / f"{name}_{i:03d}.png"
        Image.fromarray(edit.images(height, width)[0]).save(out / image, optimize=True)
        lines.append(json.dumps({"image": image.as_posix(), "instruction": edit.instruction,
                                 "target": edit.target}))
    path = out / f"{name}.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def write_edits(out: str | Path, num_train: int = 64, num_test: int = 16, seed: int = 0, height: int = HEIGHT,
                width: int = WIDTH) -> tuple[Path, Path]:
    out = Path(out)
    train, test = split_edits(num_train, num_test, seed)
    return write_split(out, "train", train, height, width), write_split(out, "test", test, height, width)


def save_pairs(out: str | Path, edits: list[SignEdit], height: int = HEIGHT, width: int = WIDTH) -> Path:
    """OUT/pairs.npz: `pair_arrays` of `edits` (sources, edited, instructions)."""
    sources, edited, instructions = pair_arrays(edits, height, width)
    path = Path(out) / "pairs.npz"
    np.savez(path, sources=sources, edited=edited, instructions=np.asarray(instructions))
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--train", type=int, default=64)
    parser.add_argument("--test", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--height", type=int, default=HEIGHT)
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--pairs", action="store_true", help="also write the pretraining feed DIR/pairs.npz")
    args = parser.parse_args(argv)
    print(*write_edits(args.out, args.train, args.test, args.seed, args.height, args.width))
    if args.pairs:
        print(save_pairs(args.out, split_edits(args.train, args.test, args.seed)[0], args.height, args.width))


if __name__ == "__main__":
    main()
