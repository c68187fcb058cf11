"""PPO mini-batches in the JAX train step: the old-log-prob pass and the updates, M = 1 vs M = 2, one script run.

    python scripts/bench_minibatch.py --out benchmarks/results     # full Qwen-Image size, random bf16 weights
    python scripts/bench_minibatch.py --tiny --grid 4 --txt 8 --batch 8 --micro-samples 2 --rank 4 --out DIR  # CPU

The workload of scripts/bench_train_step.py (512^2 = 1024 image + 128 text tokens, true CFG 4, SDE window 2,
LoRA r=64, remat save_matmuls, random latents) with old_log_prob="recompute", B samples per step in micro-batches
of --micro-samples samples. M = 1: one update, no pass (logp_old is the update's own logp). M = 2: the
forward-only pass over the whole batch, then 2 updates of B/2 samples. Reports ms per sample-step (one window
step of one sample, CFG included) of the pass and of the updates, medians over --iters steps after --warmup (the
compiling step excluded), and max |ratio - 1| of each mini-batch in the first step (mini-batch 1 is on-policy:
any deviation is the pass's and the update's bf16 forwards disagreeing). Writes train_step_minibatch.json
({name, command, device, date, figures}) into --out.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from jaxflow.trainer import phases  # noqa: E402
from jaxflow.families.qwen_image.config import QwenImageConfig  # noqa: E402
from jaxflow.trainer.train_step import make_train_step  # noqa: E402
from jaxflow_bench.timing import jax_peak_gib  # noqa: E402
from jaxflow_bench.workload import (FULL, TINY, WINDOW, add_workload_args, negatives_padded, random_model,  # noqa: E402
                                    recipe_train_config, synthetic_batch)


def measure(model, args, batch, m: int) -> dict:
    """Figures of one M: ms per sample-step of the pass (None when skipped) and of the updates, compile s."""
    tc = recipe_train_config((args.grid, args.grid), num_mini_batches=m, old_log_prob="recompute",
                             num_micro_batches=args.batch // (m * args.micro_samples))
    init_state, step = make_train_step(model, tc)
    state, t = init_state(), time.perf_counter()
    state, metrics = step(state, batch)
    metrics = jax.device_get(metrics)
    compile_s = time.perf_counter() - t
    runs = []
    for i in range(args.warmup + args.iters):
        with phases.recording() as timings:
            state, _ = step(state, batch)
        if i >= args.warmup:
            runs.append(timings)
    del state
    gc.collect()
    n = args.batch * len(WINDOW)

    def per_sample_step(key):
        return round(statistics.median(r[key] for r in runs) * 1e3 / n, 2) if key in runs[0] else None
    out = {"mini_batches": m, "samples_per_update": args.batch // m,
           "micro_batches_per_update": tc.num_micro_batches,
           "old_log_prob_ms_per_sample_step": per_sample_step("old_log_prob"),
           "update_ms_per_sample_step": per_sample_step("update"), "compile_and_first_step_s": round(compile_s, 1)}
    out["step_ms_per_sample_step"] = round(out["update_ms_per_sample_step"]
                                           + (out["old_log_prob_ms_per_sample_step"] or 0.0), 2)
    for k in range(1, m + 1):
        key = f"mb{k}/" if m > 1 else ""
        out[f"mb{k}_max_abs_ratio_minus_1"] = float(max(abs(metrics[f"{key}ratio_max"] - 1),
                                                         abs(metrics[f"{key}ratio_min"] - 1)))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(p)
    p.add_argument("--batch", type=int, default=16, help="samples per step")
    p.add_argument("--micro-samples", type=int, default=4, help="samples per micro-batch")
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args(argv)
    cfg = QwenImageConfig(**(TINY if args.tiny else FULL))
    model, _ = random_model(cfg, args.rank)
    batch = negatives_padded(synthetic_batch(cfg, args), args.txt)  # one batched CFG call, as the recipe
    rows = [measure(model, args, batch, m) for m in (1, 2)]
    for r in rows:
        print(json.dumps(r), flush=True)
    m1, m2 = rows
    guidance = recipe_train_config((args.grid, args.grid)).guidance  # the recipe's CFG scale, as the steps ran it
    figures = {"M1": m1, "M2": m2, "peak_gib": round(jax_peak_gib(), 1),
               "old_log_prob_over_update_M2": round(m2["old_log_prob_ms_per_sample_step"]
                                                    / m2["update_ms_per_sample_step"], 3),
               "step_M2_over_M1": round(m2["step_ms_per_sample_step"] / m1["step_ms_per_sample_step"], 3),
               "workload": {"batch": args.batch, "micro_samples": args.micro_samples, "image_tokens": args.grid ** 2,
                            "text_tokens": args.txt, "negative_tokens": args.neg_txt, "lora_rank": args.rank,
                            "window": len(WINDOW), "guidance": guidance, "model": "tiny" if args.tiny else "full"}}
    devices = jax.devices()
    result = {"name": "train_step_minibatch", "command": " ".join(["python", *sys.argv]),
              "device": f"{len(devices)} x {devices[0].device_kind}", "date": datetime.date.today().isoformat(),
              "figures": figures}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train_step_minibatch.json").write_text(json.dumps(result, indent=1))
    print(f"\n{result['device']}; B={args.batch}, micro-batches of {args.micro_samples}, window {len(WINDOW)}, CFG 4; "
          f"ms per sample-step (median of {args.iters})")
    print(f"{'M':>2s} {'old-logp pass':>13s} {'updates':>8s} {'step':>8s} {'compile s':>9s} {'max|r-1| mb1':>12s} "
          f"{'mb2':>9s}")
    for r in rows:
        old = r["old_log_prob_ms_per_sample_step"]
        print(f"{r['mini_batches']:2d} {'skipped' if old is None else f'{old:.2f}':>13s} "
              f"{r['update_ms_per_sample_step']:8.2f} {r['step_ms_per_sample_step']:8.2f} "
              f"{r['compile_and_first_step_s']:9.1f} {r['mb1_max_abs_ratio_minus_1']:12.2e} "
              f"{r.get('mb2_max_abs_ratio_minus_1', float('nan')):9.2e}")
    print(f"pass / updates (M=2): {figures['old_log_prob_over_update_M2']:.3f}; "
          f"step M=2 / M=1: {figures['step_M2_over_M1']:.3f}; peak {figures['peak_gib']} GiB")


if __name__ == "__main__":
    main()
