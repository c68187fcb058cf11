"""The planner's predicted step time against the measured one, per run: the `machine:` line a GPU run prints at its
start (`jaxflow.config.planner.Plan.summary`) and the run's metrics.jsonl (the median `time/step` after the first
step, which compiles).

    python -m jaxflow_bench.plan_vs_measured OUT RUN [RUN ...]
    python -m jaxflow_bench.plan_vs_measured OUT --arms [benchmarks/results/e2e_algorithms.json]

RUN: a run's output folder holding train.log and metrics.jsonl, or run/metrics.jsonl (what `jaxflow_bench.e2e` and
`jaxflow_bench.trust` write). The measured img/GPU/s is the prediction's scaled by predicted over measured step time
(the same images a step on the same GPUs). Writes OUT/plan_vs_measured.json; one line and exit 2 for a run that
printed no prediction. --arms: the planner's step for each algorithm arm that `python -m jaxflow_bench.e2e OUT --arms
...` measured on one H200 (the recipe with the arm's `e2e_series.ARMS` overrides, as that benchmark runs it), planned
now from the cost table, against the measured step: OUT/plan_arms.json.
"""
from __future__ import annotations

import argparse
import ast
import functools
import json
import re
import statistics
import sys
from pathlib import Path

from jaxflow.config import machine, planner
from jaxflow.config.validation import config_module
from jaxflow_bench import phase_costs
from jaxflow_bench.e2e_series import ARMS
from jaxflow_bench.results import write_result

ROOT = Path(__file__).resolve().parents[1]
ARMS_RESULT = ROOT / "benchmarks" / "results" / "e2e_algorithms.json"
H200 = planner.Card("NVIDIA H200", 140.4)  # the arms' card, as nvidia-smi reports its memory

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


def arm_job(arm: str) -> planner.Job:
    """configs/qwen_ocr.py as `jaxflow_bench.e2e --arms ARM` runs it on one GPU: 2 prompts x 16 images, vLLM-Omni
    colocated, 4 samples a micro-batch, the arm's overrides."""
    cfg = config_module(ROOT / "configs" / "qwen_ocr.py").get_config()
    cfg.sample.prompts_per_step, cfg.rollout.layout, cfg.rollout.engine = 2, "colocated", "vllm_omni"
    cfg.train.num_micro_batches = 4
    for flag in ARMS[arm]:
        key, value = flag.removeprefix("--config.").split("=", 1)
        *path, name = key.split(".")
        node = functools.reduce(lambda d, k: d[k], path, cfg)  # train.nft.kl as well as train.beta
        try:
            node[name] = ast.literal_eval(value)  # numbers and booleans; a name stays a string
        except (ValueError, SyntaxError):
            node[name] = value
    return machine.job_of(cfg)


def arm_figures(result: Path) -> dict:
    """Predicted and measured step (s) of every arm in `result` (e2e_algorithms.json) on one H200."""
    measured = json.loads(result.read_text())["figures"]
    sizes = planner.ModelSizes(**phase_costs.RECIPE, lora_params=phase_costs.memory_row(
        json.loads((result.parent / phase_costs.MEMORY_FILE).read_text()))[1])
    table, figs = planner.load_table(), {}
    for arm in (a for a in ARMS if f"{a}/step_s" in measured):
        predicted = planner.plan_machine(arm_job(arm), sizes, H200, 1, table).step_s
        figs.update({f"{arm}/predicted_step_s": predicted, f"{arm}/measured_step_s": measured[f"{arm}/step_s"],
                     f"{arm}/error": predicted / measured[f"{arm}/step_s"] - 1})
    figs["max_abs_error"] = max(abs(v) for k, v in figs.items() if k.endswith("/error"))
    figs["within_15pct"] = figs["max_abs_error"] <= GOAL
    return figs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("runs", type=Path, nargs="*")
    p.add_argument("--arms", type=Path, nargs="?", const=ARMS_RESULT, help="e2e_algorithms.json's arms instead")
    args = p.parse_args(argv)
    if args.arms:
        print(write_result(args.out, "plan_arms", arm_figures(args.arms),
                           command="python -m jaxflow_bench.plan_vs_measured OUT --arms " + str(args.arms.name),
                           extra={"device": f"planned for one {H200.name} ({H200.memory_gib} GiB); measured: "
                                            f"{args.arms.name}'s runs, one H200 each"}))
        return 0
    if not args.runs:
        p.error("give RUN folders, or --arms")
    try:
        figs, rows = figures(args.runs)
    except NoPrediction as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(write_result(args.out, "plan_vs_measured", figs, extra={"runs": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
