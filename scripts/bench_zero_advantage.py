"""The zero-advantage filter's cost: the recipe's train step on a batch with some prompt groups at advantage 0,
`train.drop_zero_advantage` off against on, in one script run.

    python scripts/bench_zero_advantage.py --out DIR       # full Qwen-Image size, random bf16 weights (a GPU)
    python scripts/bench_zero_advantage.py --tiny --grid 4 --txt 8 --batch 32 --micro-samples 2 --rank 4 --out DIR

The workload of scripts/bench_minibatch.py (the recipe's train config: 2 mini-batches, the old-log-prob pass, true
CFG, SDE window 2) on B samples in prompt groups of --group, where --zero-groups of the groups have advantage 0 (a
group of equal rewards), spread over the mini-batches. Off: every micro-batch runs (a mask on the zero rows would
cost the same: the shapes are fixed for jit). On: the driver's compaction (`minibatches.compact_zero_advantage`)
gathers the zero rows into whole micro-batches, which the pass and the updates skip. Reports the step's median ms
(after --warmup, the compiling step excluded), the skipped micro-batches, and on / off against the share of
micro-batches that still run. Writes train_step_zero_advantage.json into --out.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxflow.trainer.minibatches import compact_zero_advantage  # noqa: E402
from jaxflow.families.qwen_image.config import QwenImageConfig  # noqa: E402
from jaxflow.trainer.train_step import make_train_step  # noqa: E402
from jaxflow_bench.results import write_result  # noqa: E402
from jaxflow_bench.workload import (FULL, TINY, add_workload_args, negatives_padded, random_model,  # noqa: E402
                                    recipe_train_config, synthetic_batch, time_steps)


def grouped_advantages(batch: int, group: int, zero_groups: int, seed: int = 0) -> np.ndarray:
    """Per-row advantages of `batch // group` prompt groups (rows of a group adjacent, as the driver lays them out),
    normalised within each group; `zero_groups` groups, every other one from the first, all 0."""
    groups = batch // group
    if batch % group or not 0 <= zero_groups <= groups:
        raise SystemExit(f"--batch {batch} must be whole groups of {group}, --zero-groups at most {groups}")
    adv = np.random.default_rng(seed).standard_normal((groups, group)).astype(np.float32)
    adv = (adv - adv.mean(axis=1, keepdims=True)) / adv.std(axis=1, keepdims=True)
    zero = (list(range(0, groups, 2)) + list(range(1, groups, 2)))[:zero_groups]
    adv[zero] = 0.0
    return adv.reshape(-1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(p)
    p.add_argument("--batch", type=int, default=32, help="samples per step")
    p.add_argument("--group", type=int, default=4, help="samples per prompt group")
    p.add_argument("--zero-groups", type=int, default=4, help="groups whose advantages are all 0")
    p.add_argument("--micro-samples", type=int, default=4, help="samples per micro-batch")
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args(argv)
    cfg = QwenImageConfig(**(TINY if args.tiny else FULL))
    model, _ = random_model(cfg, args.rank)
    raw = synthetic_batch(cfg, args)
    raw["advantages"] = grouped_advantages(args.batch, args.group, args.zero_groups)
    batch = negatives_padded(raw, args.txt)
    base = recipe_train_config((args.grid, args.grid))
    micro = args.batch // (base.num_mini_batches * args.micro_samples)
    rows = {}
    for on in (False, True):
        tc = dataclasses.replace(base, num_micro_batches=micro, drop_zero_advantage=on)
        init_state, step = make_train_step(model, tc)
        data = compact_zero_advantage(batch, tc.num_mini_batches, micro) if on else batch
        state, metrics = step(init_state(), data)  # compiles
        ms, _ = time_steps(step, state, data, args)
        metrics = jax.device_get(metrics)
        rows[on] = {"step_ms": round(ms, 2), "micro_skipped": int(metrics.get("micro_skipped", 0))}
        print(f"drop_zero_advantage={on}: {rows[on]}", flush=True)
    total = base.num_mini_batches * micro
    runs = (total - rows[True]["micro_skipped"]) / total
    figures = {"off_step_ms": rows[False]["step_ms"], "on_step_ms": rows[True]["step_ms"],
               "on_over_off": round(rows[True]["step_ms"] / rows[False]["step_ms"], 3),
               "micro_batches": total, "micro_skipped": rows[True]["micro_skipped"],
               "share_of_micro_batches_run": round(runs, 3), "zero_rows": args.zero_groups * args.group,
               "batch": args.batch, "micro_samples": args.micro_samples, "model": "tiny" if args.tiny else "full"}
    path = write_result(args.out, "train_step_zero_advantage", figures, command=" ".join(["python", *sys.argv]))
    print(f"\n{args.batch} samples, {args.zero_groups * args.group} at advantage 0; {total} micro-batches of "
          f"{args.micro_samples}; step ms (median of {args.iters})")
    print(f"off {figures['off_step_ms']:.1f}  on {figures['on_step_ms']:.1f}  on/off {figures['on_over_off']:.3f}  "
          f"(micro-batches run: {runs:.3f})  {path}")


if __name__ == "__main__":
    main()
