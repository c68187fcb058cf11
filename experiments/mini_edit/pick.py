"""Pick the pretraining length: score each pretraining snapshot's held-out edit-OCR and install into the pipeline the
one closest to a target, so RL starts from a model that already edits somewhat but leaves room to rise.

    python -m experiments.mini_edit.pick --pipeline OUT/pipeline --snapshots OUT/snapshots/* --data OUT/data/test.jsonl
        --json OUT/pick.json [--target 0.5 --num 48 --steps 10 --device cuda]

A snapshot is a folder named by its pretraining step holding transformer/ (`python -m experiments.mini_edit.pretrain
--save-at ... --snapshots OUT/snapshots`). Each is scored in this one process by `experiments.mini_edit.evaluate` on
the pipeline's other components and the first --num held-out pairs; the closest to --target wins (ties to the
earlier step), and its transformer/ replaces the pipeline's. OUT/pick.json holds every snapshot's score and the choice.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from experiments.mini_edit.evaluate import evaluate
from jaxflow.run.data import load_prompts


def snapshot_steps(folders: list[Path]) -> dict[int, Path]:
    """{step: folder} of snapshot folders named by their step; ValueError (one line) for a folder that is not one."""
    out = {}
    for folder in folders:
        if not folder.name.isdigit() or not (folder / "transformer" / "config.json").is_file():
            raise ValueError(f"snapshot {folder}: expected a folder named by its step holding transformer/config.json "
                             f"(written by pretrain --save-at STEPS --snapshots DIR)")
        out[int(folder.name)] = folder
    return dict(sorted(out.items()))


def closest(scores: dict[int, float], target: float) -> int:
    """The step whose score is closest to `target`; ties go to the earlier step."""
    return min(scores, key=lambda step: (abs(scores[step] - target), step))


@contextmanager
def with_transformer(pipeline: Path, transformer: Path) -> Iterator[Path]:
    """A temporary pipeline folder: `pipeline`'s components (linked) with `transformer` as its transformer/."""
    with tempfile.TemporaryDirectory(prefix="pick-") as tmp:
        folder = Path(tmp)
        for entry in pipeline.iterdir():
            if entry.name != "transformer":
                (folder / entry.name).symlink_to(entry.resolve())
        (folder / "transformer").symlink_to(transformer.resolve())
        yield folder


def install(transformer: Path, pipeline: Path) -> None:
    """Replace `pipeline`/transformer/ by a copy of `transformer`: copied beside it first, so a failed copy leaves
    the pipeline as it was."""
    staged, old = pipeline / "transformer.picked", pipeline / "transformer.old"
    shutil.rmtree(staged, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    shutil.copytree(transformer, staged)
    (pipeline / "transformer").rename(old)
    staged.rename(pipeline / "transformer")
    shutil.rmtree(old)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pipeline", type=Path, required=True, help="the pipeline folder; its transformer/ is replaced")
    p.add_argument("--snapshots", type=Path, nargs="+", required=True, help="snapshot folders, each STEP/transformer/")
    p.add_argument("--data", type=Path, required=True, help="held-out edit JSONL (experiments/mini_edit/signs.py)")
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--target", type=float, default=0.5, help="the edit-OCR the picked snapshot is closest to")
    p.add_argument("--num", type=int, default=48, help="held-out pairs scored per snapshot")
    p.add_argument("--steps", type=int, help="denoising steps (default: the config's eval.num_steps)")
    p.add_argument("--device", default=None)
    a = p.parse_args(argv)
    try:
        snapshots = snapshot_steps(a.snapshots)
    except ValueError as e:
        p.exit(2, f"error: {e}\n")
    items, start, scores = load_prompts(a.data)[:a.num], time.perf_counter(), {}
    for step, folder in snapshots.items():
        with with_transformer(a.pipeline, folder / "transformer") as pipeline:
            out = evaluate(pipeline, items, steps=a.steps, device=a.device)
        scores[step] = dict(mean=out["mean"], se=out["se"])
        print(f"pick: step {step} edit-OCR {out['mean']:.3f} ± {out['se']:.3f} (n={out['n']})")
    chosen = closest({step: s["mean"] for step, s in scores.items()}, a.target)
    install(snapshots[chosen] / "transformer", a.pipeline)
    result = dict(target=a.target, n=len(items), step=chosen, mean=scores[chosen]["mean"],
                  scores={str(step): s for step, s in scores.items()}, seconds=round(time.perf_counter() - start, 1))
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result) + "\n")
    print(f"pick: step {chosen} (edit-OCR {result['mean']:.3f}, closest to {a.target}) -> {a.pipeline}/transformer")


if __name__ == "__main__":
    main()
