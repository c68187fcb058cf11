"""The planner's predicted step time against the measured one, per run: the `machine:` line a GPU run prints at its
start (`jaxflow.config.planner.Plan.summary`) and the run's metrics.jsonl (the median `time/step` after the first
step, which compiles).

    python -m jaxflow_bench.plan_vs_measured OUT RUN [RUN ...]

RUN: a run's output folder holding train.log and metrics.jsonl, or run/metrics.jsonl (what `jaxflow_bench.e2e` and
`jaxflow_bench.trust` write). The measured img/GPU/s is the prediction's scaled by predicted over measured step time
(the same images a step on the same GPUs). Writes OUT/plan_vs_measured.json; one line and exit 2 for a run that
printed no prediction.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from jaxflow_bench.results import write_result

LINE = re.compile(r"machine: (\d+) x (.+?) \((\d+) GiB\): layout (\S+), (\S+) engine.*; predicted ([\d.]+) s a step, "
                  r"([\d.]+) img/GPU/s")
GOAL = 0.15  # the bound on |predicted / measured - 1|


class NoPrediction(ValueError):
    """A run folder without a plan prediction or without measured steps."""


def compare(run: Path) -> dict:
    """One run's predicted and measured step (s) and img/GPU/s, its GPUs, card and layout."""
    log = run / "train.log"
    found = LINE.search(log.read_text(errors="replace")) if log.is_file() else None
    if found is None:
        raise NoPrediction(f"{run}: no 'machine: ... predicted N s a step' line in train.log (a GPU run prints it)")
    gpus, card, _, layout, engine, step, img = found.groups()
    metrics = next((p for p in (run / "metrics.jsonl", run / "run" / "metrics.jsonl") if p.is_file()), None)
    steps = [json.loads(line)["time/step"] for line in metrics.read_text().splitlines()[1:]] if metrics else []
    if not steps:
        raise NoPrediction(f"{run}: no steps after the first in metrics.jsonl to measure")
    measured = statistics.median(steps)
    return {"gpus": int(gpus), "card": card, "layout": layout, "engine": engine, "predicted_step_s": float(step),
            "measured_step_s": measured, "predicted_img_per_gpu_s": float(img),
            "measured_img_per_gpu_s": float(img) * float(step) / measured,
            "error": float(step) / measured - 1, "steps": len(steps)}


def figures(runs: list[Path]) -> tuple[dict, list[dict]]:
    rows = [compare(r) for r in runs]
    figs = {}
    for r in rows:
        key = f"{r['gpus']}gpu_{r['layout']}"
        figs.update({f"{key}/{k}": r[k] for k in ("predicted_step_s", "measured_step_s", "predicted_img_per_gpu_s",
                                                  "measured_img_per_gpu_s", "error")})
    figs["max_abs_error"] = max(abs(r["error"]) for r in rows)
    figs["within_15pct"] = figs["max_abs_error"] <= GOAL
    return figs, rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("runs", type=Path, nargs="+")
    args = p.parse_args(argv)
    try:
        figs, rows = figures(args.runs)
    except NoPrediction as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(write_result(args.out, "plan_vs_measured", figs, extra={"runs": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
