"""Where the GPU time goes: kernel-time breakdown of the JAX FlowGRPO train step and of the torch rollout.

    python scripts/profile_step.py --out DIR [--model DIR]     # full size, random weights (model.init=random)

Rollout: one `RolloutPipeline.generate` of 16 images (512^2, 10 steps, CFG 4, window 2) under torch.profiler.
Train step: the bench_train_step.py workload (B=8 in 2 micro-batches) under jax.profiler, after a warm-up step.
Both traces are read back and every GPU kernel is put in one class (attention, matmul, convolution, collective,
copy, other = XLA fusions / elementwise / reductions); prints the share of kernel time per class and the top
kernels. Traces stay under DIR.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import collections  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

CLASSES = (("attention", ("sdpa", "fmha", "flash", "attention", "cudnn")), ("collective", ("nccl",)),
           ("copy", ("memcpy", "memset")), ("convolution", ("convolution", "conv2d", "conv3d", "winograd", "xmma_fprop", "dgrad", "wgrad")),
           ("matmul", ("gemm", "cublas", "nvjet", "xmma", "cutlass", "matmul")))


def kernel_class(name: str) -> str:
    low = name.lower()
    return next((c for c, keys in CLASSES if any(k in low for k in keys)), "other")


def gpu_kernels(trace: dict) -> list[tuple[str, float]]:
    """(name, microseconds) of every GPU kernel: torch marks them cat=kernel; JAX/XLA traces put them on the
    "Stream #N" threads of the process named for the GPU (its "XLA Ops"/"XLA Modules" lines repeat them)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    meta = [e for e in events if e.get("ph") == "M"]
    gpu_pids = {e["pid"] for e in meta if e.get("name") == "process_name"
                and "gpu" in str(e.get("args", {}).get("name", "")).lower()}
    streams = {(e["pid"], e["tid"]) for e in meta if e.get("name") == "thread_name" and e.get("pid") in gpu_pids
               and str(e.get("args", {}).get("name", "")).startswith("Stream")}
    return [(e["name"], float(e["dur"])) for e in events if e.get("ph") == "X" and "dur" in e
            and (e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") or
                 (e.get("pid") in gpu_pids and (not streams or (e["pid"], e.get("tid")) in streams)))]


def breakdown(title: str, kernels, wall_s: float, top: int = 12) -> dict:
    total = sum(d for _, d in kernels) or 1.0
    by_class, by_name = collections.Counter(), collections.Counter()
    for name, d in kernels:
        by_class[kernel_class(name)] += d
        by_name[name] += d
    print(f"\n{title}: wall {wall_s * 1e3:.0f} ms, GPU kernel time {total / 1e3:.0f} ms "
          f"({total / 1e6 / wall_s:.0%} of wall), {len(kernels)} kernels")
    for c, d in by_class.most_common():
        print(f"  {c:12s} {d / 1e3:9.1f} ms {d / total:6.1%}")
    print("  top kernels:")
    for name, d in by_name.most_common(top):
        print(f"    {d / total:6.1%} [{kernel_class(name)}] {name[:110]}")
    return {"wall_ms": wall_s * 1e3, "kernel_ms": total / 1e3,
            "classes": {c: d / 1e3 for c, d in by_class.items()},
            "top": [(n, d / 1e3) for n, d in by_name.most_common(top)]}


def profile_rollout(folder: Path, out: Path) -> dict:
    import torch

    from bridge.rollout.pipeline import RolloutPipeline
    from bridge.rollout.sampling import SamplingParams
    pipe = RolloutPipeline.from_pretrained(folder, "bfloat16", "cuda", random_seed=0)
    sp = SamplingParams()  # flow_grpo's Qwen-Image recipe: 512^2, 10 steps, CFG 4, sde 1.2, window 2 in [0, 5)
    prompts = ['a hot air balloon with "MIDNIGHT VALLEY" written on the envelope']
    pipe.generate(prompts, 16, sp, list(range(16)))  # warm-up
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        pipe.generate(prompts, 16, sp, list(range(16, 32)))
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    path = out / "rollout_trace.json"
    prof.export_chrome_trace(str(path))
    del pipe
    torch.cuda.empty_cache()
    return breakdown("torch rollout, 16 images (512^2, 10 steps, CFG 4)", gpu_kernels(json.loads(path.read_text())),
                     wall)


def profile_train_step(folder: Path, out: Path, batch: int, micro: int) -> dict:
    import jax
    from bench_train_step import synthetic_batch

    from jaxflow.models.config import ModelOptions, QwenImageConfig
    from jaxflow.models.lora import LoRASpec
    from jaxflow.models.random_init import random_transformer
    from jaxflow.train_step import TrainConfig, make_train_step

    cfg = QwenImageConfig.from_json(folder / "transformer" / "config.json")
    opts = ModelOptions(dtype="bfloat16", param_dtype="bfloat16", remat="save_matmuls")
    model = random_transformer(cfg, opts, LoRASpec(rank=64, alpha=128.0), seed=0)
    init_state, step = make_train_step(model, TrainConfig(grid_hw=(32, 32), guidance=4.0, num_micro_batches=micro))
    args = argparse.Namespace(batch=batch, grid=32, txt=128, neg_txt=8)
    data = synthetic_batch(cfg, args)
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
    path = max((p for p in trace_dir.rglob("*.trace.json.gz") if not p.name.startswith("perfetto")),
               key=lambda p: p.stat().st_mtime)
    trace = json.loads(gzip.decompress(path.read_bytes()))
    return breakdown(f"JAX train step, B={batch} in {micro} micro-batches (window 2, CFG 4)", gpu_kernels(trace),
                     wall)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", type=Path, default=Path("/tmp/qwen_random"))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--phase", default="both", choices=("both", "train_step"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not (args.model / "model_index.json").exists():
        subprocess.run([sys.executable, str(Path(__file__).with_name("make_random_pipeline.py")), "--out",
                        str(args.model), "--no-transformer-weights"], check=True)
    if args.phase == "train_step":  # its own process: CUPTI takes one profiler per process
        result = {"train_step": profile_train_step(args.model, args.out, args.batch, args.micro)}
        (args.out / "profile_train_step.json").write_text(json.dumps(result, indent=1))
        return
    result = {"rollout": profile_rollout(args.model, args.out)}
    subprocess.run([sys.executable, __file__, "--phase", "train_step", *(argv or sys.argv[1:])], check=True)
    result.update(json.loads((args.out / "profile_train_step.json").read_text()))
    (args.out / "profile.json").write_text(json.dumps(result, indent=1))
    print(f"\n{'phase':12s} {'wall ms':>8s} " + " ".join(f"{c:>11s}" for c, _ in CLASSES) + f" {'other':>11s}")
    for phase, r in result.items():
        shares = [r["classes"].get(c, 0) / r["kernel_ms"] for c, _ in CLASSES + (("other", ()),)]
        print(f"{phase:12s} {r['wall_ms']:8.0f} " + " ".join(f"{s:11.1%}" for s in shares))


if __name__ == "__main__":
    main()
