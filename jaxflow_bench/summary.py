"""Throughput and phase breakdown of a training run from its metrics.jsonl (steps after the first: compile).

    python -m jaxflow_bench.summary RUN_DIR [--gpus N] [--result NAME --command CMD --out DIR]

With --result, the medians are also written as DIR/NAME.json (jaxflow_bench/results.py). `summarize` is the
mapping from a run's metrics to a result's figures that every end-to-end benchmark (jaxflow_bench.e2e) writes.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from jaxflow_bench.results import write_result

KEYS = ("time/step", "time/rollout", "time/reward", "time/train", "time/to_device", "time/sync", "time/old_log_prob",
        "time/update", "time/sleep", "time/wake", "rollout_freed_gib", "bound_modules", "micro_batch", "jax_peak_gib")


def mismatch_figures(rows: list[dict]) -> dict:
    """The rollout/trainer log-prob mismatch of metrics rows (FlowGRPO's; DiffusionNFT logs none): logp_diff_max
    (the largest |logp - logp_rollout|), logp_diff_p50 (the median over steps and window steps of each window step's
    mean |logp - logp_rollout|), logp_diff_p99 (the 99th percentile over steps and window steps of each window step's
    largest); with rollout correction rejected_share (the median step's share of samples x window steps rejected,
    `rejected_frac`)."""
    def values(prefix):
        return [v for r in rows for k, v in r.items() if k.startswith(prefix)]

    out, means, maxes = {}, values("logp_diff_mean/"), values("logp_diff_max/")
    if maxes:
        out.update(logp_diff_max=max(maxes), logp_diff_p50=float(np.percentile(means, 50)),
                   logp_diff_p99=float(np.percentile(maxes, 99)))
    rejected = [r["rejected_frac"] for r in rows if "rejected_frac" in r]
    if rejected:
        out["rejected_share"] = statistics.median(rejected)
    return out


def metrics_rows(run_dir: Path) -> list[dict]:
    """The rows of the run's metrics.jsonl, each a step's; a last line the trainer is still writing (no newline yet)
    is left for the next read."""
    text = (Path(run_dir) / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]


def steady_figures(rows: list[dict], gpus: int = 1, skip: int = 1, exclude=(),
                   gpu_mem: Path | None = None) -> dict | None:
    """The figures of the steady steps of metrics `rows` (after `skip`, but for `exclude`): medians of img/GPU/s and
    each phase, the log-prob mismatch, and with `gpu_mem` (nvidia-smi memory.used, MiB per line) the peak as
    peak_gib; None when no step is left."""
    steady = [r for r in rows[skip:] if r["step"] not in exclude]
    if not steady:
        return None
    figures = {"img_per_gpu_s": statistics.median(r["images_per_s"] for r in steady) / gpus, "gpus": gpus,
               "images_per_step": round(steady[0]["images_per_s"] * steady[0]["time/step"]),
               "steps_timed": len(steady)}
    for key in KEYS:
        if key in steady[0]:
            figures[key.replace("time/", "") + ("_s" if key.startswith("time/") else "")] = \
                statistics.median(r[key] for r in steady)
    for key in sorted(k for k in steady[0] if k.startswith("time/reward_busy/")):  # scoring seconds per reward
        figures[f"reward_busy_{key.rpartition('/')[2]}_s"] = statistics.median(r[key] for r in steady)
    figures["share_of_step_sync"] = figures["sync_s"] / figures["step_s"]
    figures.update(mismatch_figures(steady))
    if gpu_mem and Path(gpu_mem).is_file():
        used = [int(x) for x in Path(gpu_mem).read_text().split() if x.isdigit()]
        if used:
            figures["peak_gib"] = max(used) / 1024
    return figures


def print_steps(rows: list[dict], gpus: int = 1) -> None:
    """A table of the run's steps: each phase's seconds, img/GPU/s and the largest log-prob mismatch."""
    print(f"{'step':>4s} {'rollout':>8s} {'reward':>7s} {'train':>7s} {'sync':>6s} {'wall':>7s} {'img/GPU/s':>9s} "
          f"{'logp_diff_max':>13s}")
    for r in rows:
        total = r["time/step"]  # wall time of the step: the phases and everything between them
        diff = max((v for k, v in r.items() if k.startswith("logp_diff_max/")), default=None)  # none with NFT
        print(f"{r['step']:4d} {r['time/rollout']:8.1f} {r['time/reward']:7.1f} {r['time/train']:7.1f} "
              f"{r['time/sync']:6.1f} {total:7.1f} {r['images_per_s'] / gpus:9.3f} "
              + (f"{diff:13.2e}" if diff is not None else f"{'-':>13s}"))


def summarize(run_dir: Path, gpus: int = 1, skip: int = 1, exclude=(), gpu_mem: Path | None = None) -> dict | None:
    """Print the run's steps and return `steady_figures` of its metrics.jsonl."""
    rows = metrics_rows(run_dir)
    print_steps(rows, gpus)
    figures = steady_figures(rows, gpus, skip, exclude, gpu_mem)
    if figures is not None:
        print(f"median over steps {[r['step'] for r in rows[skip:] if r['step'] not in exclude]}: "
              f"{figures['img_per_gpu_s']:.3f} img/GPU/s")
    return figures


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--skip", type=int, default=1, help="leading steps to leave out (compile)")
    p.add_argument("--exclude", type=int, nargs="*", default=[], help="steps to leave out (a profiled step)")
    p.add_argument("--result", help="write the medians as OUT/RESULT.json")
    p.add_argument("--command", help="the command that made the run (for the result file)")
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--gpu-mem", type=Path, help="nvidia-smi memory.used log (MiB per line, GPUs interleaved): its "
                                                "maximum is written as peak_gib")
    args = p.parse_args(argv)
    figures = summarize(args.run_dir, args.gpus, args.skip, args.exclude, args.gpu_mem)
    if figures is not None and args.result:
        print(write_result(args.out, args.result, figures, command=args.command))


if __name__ == "__main__":
    main()
