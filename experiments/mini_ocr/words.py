"""Deterministic pseudo-words (uppercase A-Z, 3-5 letters), a train/held-out split and OCR-format prompts.

Words are seeded random letter strings, not dictionary words: nothing to download, and a held-out word shares no
string with training, only letters, so the eval measures letter-level generalisation.

CLI: ``python -m experiments.mini_ocr.words --out DIR [--train 4000 --test 200 --seed 0]`` writes DIR/train.txt and
DIR/test.txt, one prompt a line (the format `jaxflow.run.data.load_prompts` reads).
"""
from __future__ import annotations

import argparse
import string
from pathlib import Path

import numpy as np

LETTERS = string.ascii_uppercase
MIN_LEN, MAX_LEN = 3, 5
PROMPT = 'A sign that reads "{}"'


def make_words(count: int, seed: int = 0) -> list[str]:
    """`count` distinct words, lengths uniform in [MIN_LEN, MAX_LEN], a pure function of (count, seed)."""
    capacity = sum(len(LETTERS) ** n for n in range(MIN_LEN, MAX_LEN + 1))
    if not 0 < count <= capacity // 2:
        raise ValueError(f"count must be in [1, {capacity // 2}], got {count}")
    rng = np.random.default_rng(seed)
    words: dict[str, None] = {}
    while len(words) < count:
        n = int(rng.integers(MIN_LEN, MAX_LEN + 1))
        words["".join(rng.choice(list(LETTERS), n))] = None
    return list(words)


def split(num_train: int, num_test: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """(train, test) words, disjoint; the test words are the last `num_test` drawn."""
    words = make_words(num_train + num_test, seed)
    return words[:num_train], words[num_train:]


def prompt(word: str) -> str:
    return PROMPT.format(word)


def write_prompts(out: str | Path, num_train: int, num_test: int, seed: int = 0) -> tuple[Path, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, words in zip(("train", "test"), split(num_train, num_test, seed)):
        path = out / f"{name}.txt"
        path.write_text("".join(prompt(w) + "\n" for w in words))
        paths.append(path)
    return paths[0], paths[1]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--train", type=int, default=4000)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(*write_prompts(args.out, args.train, args.test, args.seed))


if __name__ == "__main__":
    main()
