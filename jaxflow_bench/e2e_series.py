"""`python -m jaxflow_bench.e2e OUT --scaling` and `--arms`: several of its runs one after the other (each a `run`
of `jaxflow_bench.e2e`, handed in), then one result that puts their figures side by side (`e2e.py`'s docstring
says what each writes)."""
from __future__ import annotations

import argparse
import json
import os
import shlex
from collections.abc import Callable
from pathlib import Path

from jaxflow_bench.results import finished, scaling_figures, write_result

# each algorithm arm's overrides of the recipe: those of configs/mini_ocr.py's ARMS that define the algorithm
# (tests/bench checks the match). Its mini-size choices stay there: mixgrpo's window interval, the evals' CFG, and
# awm's one mini-batch a step (the same forward and backward work; the micro-batches here are sized from the recipe's)
ARMS = {"flowgrpo": [], "guard": ["--config.train.ratio_norm=guard"],
        "corrected": ["--config.train.old_log_prob=rollout_corrected"],
        "dropzero": ["--config.train.drop_zero_advantage=True"],
        "nft": ["--config.train.algorithm=nft", "--config.sample.guidance=1", "--config.sample.sde_type=ode"],
        "mixgrpo": ["--config.train.algorithm=mixgrpo", "--config.sample.window_size=2"],
        "mixgrpo_flash": ["--config.train.algorithm=mixgrpo", "--config.sample.window_size=2",
                          "--config.sample.solver=dpm2"],
        "awm": ["--config.train.algorithm=awm", "--config.train.beta=0.003", "--config.train.old_log_prob=rollout"]}


def scaling(args, overrides: list[str], run: Callable[..., Path]) -> Path:
    """1gpu on GPU 0, then each of args.layouts on two GPUs (a whole result already in OUT is kept: layouts measured
    side by side on a larger host are put together; a partial one is run again), then OUT/e2e_2gpu.json."""
    out = Path(args.out)
    one = out / "1gpu" / "e2e_1gpu.json"
    if not finished(one):
        run(argparse.Namespace(**{**vars(args), "out": one.parent, "layout": "1gpu", "prompts": 2, "per_call": 1,
                                  "result": "e2e_1gpu"}), overrides, dict(os.environ, CUDA_VISIBLE_DEVICES="0"))
    layouts = {}
    for layout in args.layouts:
        result = "e2e_2gpu_colocated" if layout == "2gpu_colocated" else "e2e_2gpu_split"
        path = out / layout / f"{result}.json"
        if not finished(path):
            env, extra, micro = dict(os.environ), [], args.micro
            if layout == "2gpu_colocated":
                env["XLA_CLIENT_MEM_FRACTION"], micro = str(args.colocated_pool), args.colocated_micro
            else:
                extra = ["--config.rollout.overlap=True"]
            run(argparse.Namespace(**{**vars(args), "out": path.parent, "layout": layout, "prompts": 4,
                                      "per_call": 1, "micro": micro, "result": result}), extra + overrides, env)
        layouts[layout] = json.loads(path.read_text())["figures"]
    figures = scaling_figures(json.loads(one.read_text())["figures"], layouts)
    print(json.dumps(figures, indent=1))
    return write_result(out, "e2e_2gpu", figures, command=shlex.join(
        ["python", "-m", "jaxflow_bench.e2e", "OUT", "--scaling", "--layouts", *layouts, *overrides]))


def arms(args, overrides: list[str], run: Callable[..., Path]) -> Path:
    """Each algorithm arm as a run of args.layout into OUT/ARM/e2e_alg_ARM.json (one start-up each, one after the
    other), then OUT/e2e_algorithms.json: every arm's whole result there (this session's or an earlier one's; not a
    partial one) side by side."""
    out = Path(args.out)
    for arm in args.arms:
        run(argparse.Namespace(**{**vars(args), "out": out / arm, "result": f"e2e_alg_{arm}"}), ARMS[arm] + overrides)
    done = {p.parent.name: json.loads(p.read_text())["figures"] for p in sorted(out.glob("*/e2e_alg_*.json"))
            if finished(p)}
    return write_result(out, "e2e_algorithms", arms_figures(done), command=shlex.join(
        ["python", "-m", "jaxflow_bench.e2e", "OUT", "--arms", *done, *overrides]))


def arms_figures(done: dict[str, dict]) -> dict:
    """{ARM: its run's figures} as `ARM/KEY`, with `ARM/step_vs_flowgrpo`, its step time over FlowGRPO's, where
    both have one."""
    figures = {f"{arm}/{k}": v for arm, r in done.items() for k, v in r.items()}
    base = done.get("flowgrpo", {}).get("step_s")
    for arm, r in done.items():
        if base and arm != "flowgrpo" and r.get("step_s"):
            figures[f"{arm}/step_vs_flowgrpo"] = r["step_s"] / base
    return figures
