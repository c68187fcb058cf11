"""Train-step scaling, 1 vs N GPUs: data parallel with the base replicated, then fsdp-sharded.

    python scripts/bench_scaling.py --out DIR              # full Qwen-Image size, random bf16 weights
    python scripts/bench_scaling.py --tiny --out DIR       # code-path check (XLA_FLAGS=--xla_force_host_platform_device_count=2)

The step of scripts/bench_train_step.py (CFG 4, window 2, LoRA r=64, remat save_matmuls) with a fixed number of
samples per GPU; efficiency = (N-GPU samples/s) / (N x 1-GPU samples/s).
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402

from jaxflow.families.qwen_image.config import QwenImageConfig  # noqa: E402
from jaxflow.trainer.sharding import DEFAULT_RULES, FSDP_RULES, Layout, ShardingConfig  # noqa: E402
from jaxflow.trainer.train_step import make_train_step  # noqa: E402
from jaxflow_bench.workload import (FULL, ONE_UPDATE, TINY, WINDOW, add_workload_args, negatives_padded,  # noqa: E402
                                    random_model, recipe_train_config, synthetic_batch, time_steps)


def run(model, cfg, args, layout: Layout, n_dev: int) -> float:
    args.batch = args.per_gpu * n_dev
    batch = negatives_padded(synthetic_batch(cfg, args), args.txt)  # one batched CFG call, as the recipe
    tc = recipe_train_config((args.grid, args.grid), num_micro_batches=args.micro, **ONE_UPDATE)
    init_state, step = make_train_step(model, tc, layout)
    return time_steps(step, init_state(), batch, args)[0]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(p)
    p.add_argument("--per-gpu", type=int, default=4, help="samples per GPU per step")
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--iters", type=int, default=4)
    args = p.parse_args(argv)
    cfg = QwenImageConfig(**(TINY if args.tiny else FULL))
    devices = jax.devices()
    n = len(devices)
    model, _ = random_model(cfg, args.rank)
    cases = [("1 GPU", Layout.create(ShardingConfig(data=1), devices[:1]), 1),
             (f"{n} GPUs data-parallel (base replicated)", Layout.create(ShardingConfig(data=n), devices), n),
             (f"{n} GPUs fsdp (base sharded on embed)",
              Layout.create(ShardingConfig(data=1, fsdp=n, rules=FSDP_RULES), devices), n)]
    rows = []
    for name, layout, k in cases:
        ms = run(model, cfg, args, layout, k)
        sps = args.per_gpu * k * len(WINDOW) / (ms / 1e3)
        rows.append({"case": name, "gpus": k, "ms_step": round(ms, 1), "sample_steps_per_s": round(sps, 2)})
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["sample_steps_per_s"]
    for r in rows:
        r["efficiency"] = round(r["sample_steps_per_s"] / (base * r["gpus"]), 3)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_scaling.json").write_text(json.dumps(rows, indent=1))
    print(f"\ndevices: {devices}; {args.per_gpu} samples/GPU, window {len(WINDOW)}, CFG 4; rules {DEFAULT_RULES}")
    print(f"{'case':44s} {'ms/step':>8s} {'sample-steps/s':>14s} {'efficiency':>10s}")
    for r in rows:
        print(f"{r['case']:44s} {r['ms_step']:8.1f} {r['sample_steps_per_s']:14.2f} {r['efficiency']:10.1%}")


if __name__ == "__main__":
    main()
