"""Where the GPU time goes: kernel-time breakdown of the JAX FlowGRPO train step and of the torch rollout.

    python scripts/profile_step.py --out DIR [--model DIR]     # full size, random weights (model.init=random)
    python scripts/profile_step.py --out DIR --phase rollout --rollout-n 32 --rollout-compile   # the rollout alone
    python scripts/profile_step.py --out DIR --trace RUN_DIR/profile
        # the trace of the real run: python -m jaxflow.train ... --config.profile.num_steps=1 (jaxflow/run/profiling.py)

Rollout: one `RolloutPipeline.generate` of 16 images (or --rollout-n; 512^2, 10 steps, CFG 4, window 2) under
torch.profiler.
Train step: the bench_train_step.py workload (B=8 in 2 micro-batches) under jax.profiler, after a warm-up step.
The train step's kernels are named by its optimized HLO, dumped under OUT/hlo (or --hlo DIR).
Both traces are read back and every GPU kernel is put in one class (attention, matmul, convolution, collective,
copy, other = XLA fusions / elementwise / reductions); prints the share of kernel time per class and the top
kernels, and the share of each named scope of the block (modulation, attention, mlp) and of the top HLO ops
(from the kernels' trace arguments, where XLA records them). Traces stay under DIR.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from jaxflow.config import derived
from jaxflow_bench.cli import bench_parser  # noqa: E402
from jaxflow_bench.kernels import (  # noqa: E402
    CLASSES,
    breakdown,
    gpu_kernels,
    hlo_op_names,
    with_hlo_dump,
    xplane_kernels,
)


def profile_rollout(folder: Path, out: Path, n: int = 16, compile_block: bool = False) -> dict:
    """One rollout call of `n` images, after a warm-up call of the same shapes, on the diffusers engine as the
    trainer builds it; `compile_block`: its `rollout.compile` (torch.compile of the repeated block)."""
    import torch

    from jaxflow_bridge.engines.diffusers import DiffusersEngine
    from jaxflow_bridge.rollout.sampling import SamplingParams
    pipe = DiffusersEngine({"engine": "diffusers", "model": str(folder), "dtype": "bfloat16", "device": "cuda",
                            "random_seed": 0, "compile": compile_block}).pipeline
    sp = SamplingParams(true_cfg_scale=4.0)  # flow_grpo's Qwen-Image recipe: 512^2, 10 steps, sde 1.2, window 2
    prompts = ['a hot air balloon with "MIDNIGHT VALLEY" written on the envelope']
    pipe.generate(prompts, n, sp, list(range(n)))  # warm-up (compiles)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        pipe.generate(prompts, n, sp, list(range(n, 2 * n)))
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    path = out / "rollout_trace.json"
    prof.export_chrome_trace(str(path))
    del pipe
    torch.cuda.empty_cache()
    return breakdown(f"torch rollout{', compiled block' if compile_block else ''}, {n} images (512^2, 10 steps, "
                     "CFG 4)", gpu_kernels(json.loads(path.read_text())), wall)


def profile_train_step(out: Path, batch: int, micro: int, hlo: Path | None = None, layers: int | None = None,
                       unroll: int | None = None, gemm: str | None = None) -> dict:
    """The bench_train_step.py workload as the Qwen recipe runs it (configs/qwen_ocr.py's remat and
    train.xla_options), full-size random weights; `layers` blocks instead of 60 (a quicker profile, the same
    per-block work); `unroll` and `gemm` instead of the recipe's model.scan_unroll and model.lora_gemm."""
    import dataclasses

    import jax

    from jaxflow.config import plan as plan_lib
    from jaxflow.families.qwen_image.config import QwenImageConfig
    from jaxflow.families.qwen_image.lora import QwenImageLoRASpec
    from jaxflow.nn.lora_gemm import on_hopper
    from jaxflow.families.qwen_image.random_init import random_transformer
    from jaxflow.config import sections
    from jaxflow.config.recipes import base
    from jaxflow.trainer.train_step import make_train_step
    from jaxflow_bench.workload import FULL, ONE_UPDATE, negatives_padded, recipe_train_config, synthetic_batch

    cfg = QwenImageConfig(**FULL)
    if layers:
        cfg = dataclasses.replace(cfg, num_layers=layers)
    recipe = base()
    if unroll:
        recipe.model.scan_unroll = unroll
    if gemm:
        recipe.model.lora_gemm = gemm
    recipe = sections.build(recipe)
    gemm, _ = plan_lib.lora_gemm(recipe, cfg.num_layers, jax.device_count(), on_hopper(), batch // micro,
                                 (32 * 32, 128))
    opts = derived.model_options(recipe, gemm, cfg.num_layers)
    model = random_transformer(cfg, opts, QwenImageLoRASpec(rank=64, alpha=128.0), seed=0)
    if model.unrolled:  # as the trainer holds them (jaxflow/trainer/learner.py)
        model.unstack_blocks()
    init_state, step = make_train_step(model, recipe_train_config((32, 32), num_micro_batches=micro, **ONE_UPDATE),
                                       compiler_options=derived.xla_options(recipe, gemm))
    args = argparse.Namespace(batch=batch, grid=32, txt=128, neg_txt=8)
    data = negatives_padded(synthetic_batch(cfg, args), args.txt)  # one batched CFG call, as the recipe
    state = init_state()
    for _ in range(2):  # compile + warm-up
        state, m = step(state, data)
        jax.block_until_ready(m)
    trace_dir = out / "jax_trace"
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        t = time.perf_counter()
        state, m = step(state, data)
        jax.block_until_ready(m)
        wall = time.perf_counter() - t
    return breakdown(f"JAX train step, B={batch} in {micro} micro-batches (window 2, CFG 4)", xplane_kernels(trace_dir),
                     wall, op_names=hlo_op_names(hlo))


def main(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--model", type=Path, default=Path("/tmp/qwen_random"), help="the rollout's pipeline folder")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--phase", default="both", choices=("both", "train_step", "rollout"))
    p.add_argument("--rollout-n", type=int, default=16, help="rollout: images in the profiled call")
    p.add_argument("--rollout-compile", action="store_true", help="rollout: torch.compile the repeated block")
    p.add_argument("--layers", type=int, help="train step: this many blocks instead of the model's 60")
    p.add_argument("--unroll", type=int, help="train step: model.scan_unroll (>= the blocks: unrolled)")
    p.add_argument("--gemm", choices=("xla", "pallas"), help="train step: model.lora_gemm")
    p.add_argument("--trace", type=Path, help="only analyse this jax.profiler trace folder (a run's profile.dir)")
    p.add_argument("--hlo", type=Path, help="the run's XLA dump (--xla_dump_to) to name the kernels' scopes; the "
                   "train_step phase makes its own under OUT/hlo when not given (some 350 MB at 60 unrolled blocks)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.trace:  # a run's trace: XLA's kernels carry their HLO module; the in-process torch rollout's do not
        kernels, op_names = xplane_kernels(args.trace), hlo_op_names(args.hlo)
        if not op_names:
            print("note: no --hlo dump, so scopes come from the trace's own op names, which put many fused kernels "
                  f"outside the blocks: run with XLA_FLAGS='{with_hlo_dump('', Path('DIR'))}' and pass --hlo DIR")
        result = {}
        for part, mine in (("xla", True), ("not_xla", False)):
            ks = [k for k in kernels if ("hlo_module" in k[2]) == mine]
            if ks:
                busy_s = sum(d for _, d, _ in ks) / 1e6
                result[part] = breakdown(f"{part} kernels of {args.trace} (wall = their kernel time)", ks, busy_s,
                                         op_names=op_names)
        if not result:
            print(f"no GPU kernels in the trace under {args.trace} (a CPU run?)")
        (args.out / "profile_trace.json").write_text(json.dumps(result, indent=1))
        return
    if args.phase == "train_step":  # its own process: CUPTI takes one profiler per process
        if args.hlo is None:  # scopes from the trace's own op names alone misplace most fusions (BENCHMARKS.md)
            args.hlo = args.out / "hlo"
            shutil.rmtree(args.hlo, ignore_errors=True)  # a rerun's names must not come from an older dump
            os.environ["XLA_FLAGS"] = with_hlo_dump(os.environ.get("XLA_FLAGS", ""), args.hlo)
        result = {"train_step": profile_train_step(args.out, args.batch, args.micro, args.hlo, args.layers,
                                                          args.unroll, args.gemm)}
        (args.out / "profile_train_step.json").write_text(json.dumps(result, indent=1))
        return
    if not (args.model / "model_index.json").exists():
        subprocess.run([sys.executable, str(Path(__file__).with_name("make_random_pipeline.py")), "--out",
                        str(args.model), "--no-transformer-weights"], check=True)
    result = {"rollout": profile_rollout(args.model, args.out, args.rollout_n, args.rollout_compile)}
    if args.phase == "rollout":
        (args.out / "profile_rollout.json").write_text(json.dumps(result, indent=1))
        return
    subprocess.run([sys.executable, __file__, "--phase", "train_step", *(argv or sys.argv[1:])], check=True)
    result.update(json.loads((args.out / "profile_train_step.json").read_text()))
    (args.out / "profile.json").write_text(json.dumps(result, indent=1))
    print(f"\n{'phase':12s} {'wall ms':>8s} " + " ".join(f"{c:>11s}" for c, _ in CLASSES) + f" {'other':>11s}")
    for phase, r in result.items():
        shares = [r["classes"].get(c, 0) / r["kernel_ms"] for c, _ in CLASSES + (("other", ()),)]
        print(f"{phase:12s} {r['wall_ms']:8.0f} " + " ".join(f"{s:11.1%}" for s in shares))


if __name__ == "__main__":
    main()
