"""Benchmark result files: `{"name", "command", "device", "date", "figures"}` as NAME.json (BENCHMARKS.md's rule:
every figure there is also written here; the files are copied into benchmarks/results/).

    from jaxflow_bench.results import write_result
    write_result(out_dir, "rollout_seed_table", {"omni_batched_img_s": 0.71}, extra={...})
"""
from __future__ import annotations

import datetime
import json
import os
import shlex
import sys
from pathlib import Path

from jaxflow.config.machine import visible_gpus


def device_name() -> str:
    """The GPU(s) this process sees (`jaxflow.config.machine.visible_gpus`) as nvidia-smi names them ("NVIDIA H200,
    143771 MiB" per GPU), else "cpu"."""
    seen = [f"{name}, {mib} MiB" for _, _, name, mib in visible_gpus()]
    if not seen:
        return "cpu"
    return f"{len(seen)} x {seen[0]}" if len(seen) > 1 else seen[0]


def significant(value, digits: int = 6):
    """A float kept to `digits` significant digits (2.38e-7 stays 2.38e-7, not 0.0); anything else as is."""
    if isinstance(value, float) and value == value and value not in (float("inf"), float("-inf")):
        return float(f"{value:.{digits}g}")
    return value


def write_result(out_dir: str | Path, name: str, figures: dict, command: str | None = None,
                 extra: dict | None = None) -> Path:
    """Write out_dir/NAME.json whole or not at all (a temporary file moved over it: a write cut short leaves the
    earlier file); `command` defaults to this process's command line."""
    record = {"name": name, "command": command or shlex.join(["python3", *sys.argv]), "device": device_name(),
              "date": datetime.date.today().isoformat(),
              "figures": {k: significant(v) for k, v in figures.items()}}
    if extra:
        record.update(extra)
    path = Path(out_dir) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def finished(path: str | Path) -> bool:
    """Whether `path` holds a whole run's result (not one a run cut short left, marked partial)."""
    return Path(path).is_file() and not json.loads(Path(path).read_text()).get("partial", False)


def scaling_figures(one: dict, layouts: dict[str, dict]) -> dict:
    """The figures of a scaling result from jaxflow_bench.e2e's results: `one`, the one-GPU run's, and `layouts`, each
    multi-GPU layout's by name (each with img_per_gpu_s, gpus and step_s). Per layout: its img/GPU/s, step time and
    scaling_vs_1gpu (its images per second over the one-GPU run's); then the best layout's as `img_per_gpu_s`,
    `scaling_vs_1gpu` and `layout`."""
    if not layouts:
        raise ValueError("no multi-GPU layout to compare with the one-GPU run")
    base = one["img_per_gpu_s"] * one["gpus"]
    out = {"one_gpu_img_per_gpu_s": one["img_per_gpu_s"], "one_gpu_step_s": one["step_s"]}
    for name, f in layouts.items():
        out.update({f"{name}/img_per_gpu_s": f["img_per_gpu_s"], f"{name}/step_s": f["step_s"],
                    f"{name}/gpus": f["gpus"], f"{name}/scaling_vs_1gpu": f["img_per_gpu_s"] * f["gpus"] / base})
    best = max(layouts, key=lambda name: out[f"{name}/scaling_vs_1gpu"])
    out.update(img_per_gpu_s=out[f"{best}/img_per_gpu_s"], scaling_vs_1gpu=out[f"{best}/scaling_vs_1gpu"], layout=best)
    return out
