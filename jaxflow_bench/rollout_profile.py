"""Where a rollout's time goes, per image: an engine's pipeline under torch.profiler (the diffusers engine in this
process, or vLLM-Omni's in its workers).

    python -m jaxflow_bench.rollout_profile OUT [--engine diffusers|vllm_omni] [--model DIR|tiny]
        [--device cuda|cpu] [--calls 3] [--prompts 2] [--n 4] [--size 512] [--steps 10] [--seed 0]
        [--lora-rank R [--lora-apply layers|merged]] [--quantization fp8] [--cfg-forward split|batched]

Runs the recipe's training rollout (jaxflow_bench.rollout.TRAIN_SETTINGS: true CFG 4, the SDE window; --size and
--steps shrink it; true CFG's rows as the recipe's rollout.cfg_forward runs them unless --cfg-forward says) on the
model (default the recipe's random full-size folder, written if missing; `tiny`: the cached tiny model) with random
weights drawn from --seed: one warm-up call, then --calls calls of --prompts prompts x --n images under
torch.profiler (CUDA kernels on a GPU, CPU ops on the CPU), and the same calls without CFG; with --lora-rank a random
adapter of that rank on the recipe's 12 targets is bound first, through a shared-memory file as the trainer's sync
sends it (served as --lora-apply, the engine's default without it), and --quantization fp8 runs vLLM-Omni's DiT in
FP8 (its LoRA as layers, which it needs). Such a variant's file is named for it: rollout_profile_fp8_lora64.json for
`--quantization fp8 --lora-rank 64`, _batched for a cfg_forward not the recipe's. The profiler runs where the
pipeline does (jaxflow_bridge/rollout/profiling.py): in this process for --engine diffusers (the default), in the
diffusion workers for --engine vllm_omni (a GPU only; the engine's `profile_start` / `profile_stop`, its first
worker's table). Writes OUT/rollout_profile.json (`result_name`; until the profiled calls are read back it holds the
unprofiled timings alone, marked partial), seconds per image:
  attention_s, gemm_s, quant_s, other_kernels_s  the kernels' (CPU: the ops') own time by name (`CATEGORIES`;
                       quant_s: an FP8 DiT's activation quantization)
  idle_gaps_s          the call's wall time the device ran nothing (launch gaps, host work, syncs)
  text_encoder_s, vae_decode_s, denoise_s  the pipeline's phases (`SamplingLoop.encode`, `decode`, the rest of
                       its `generate`), each under a torch.profiler range of its name
  trajectory_export_s  the engine's call beyond the pipeline's `generate` (the trajectory to host arrays, its dict;
                       vLLM-Omni: also its scheduling and the result's way back from the worker)
  cfg_overhead_s       wall time per image with true CFG less that without (the negative rows), both unprofiled
  unprofiled_wall_s, no_cfg_wall_s  the calls' wall time per image without the profiler, with and without CFG
and beside the figures `top_kernels`: the 15 kernels (ops) of most own time, with their categories.
"""
from __future__ import annotations

import argparse
import functools
import re
import subprocess
import sys
import time
from pathlib import Path

from jaxflow_bench.results import write_result
from jaxflow_bench.rollout import PROMPTS, TARGETS, TRAIN_SETTINGS, random_adapter
from jaxflow_bridge.contract.lora_shm import SharedAdapterFile
from jaxflow_bridge.contract.schedule import CFG_FORWARDS
from jaxflow_bridge.rollout.profiling import PHASES, PipelineProfiler

# kernel / op names to categories, first match wins (FlashAttention, cuDNN and PyTorch's SDPA kernels; a Triton kernel
# Inductor names for vLLM's scaled GEMM is the activation quantization it fused before that GEMM (a Triton kernel never
# runs the CUTLASS GEMM itself); cuBLAS(Lt), CUTLASS and nvjet GEMMs, FP8 scaled GEMMs, ATen's GEMM ops on the CPU; an
# FP8 DiT's activation quantization: vLLM's scale reduction and cast kernels, or the amax reductions Inductor fuses)
CATEGORIES = (("attention", re.compile(r"flash|fmha|attention|sdpa|softmax", re.I)),
              ("quant", re.compile(r"^triton_\w*scaled_mm")),
              ("gemm", re.compile(r"gemm|cutlass|cublas|nvjet|xmma|scaled_mm|aten::(addmm|mm|bmm|matmul|linear)\b"
                                  r"|^void at::native::\w*mm", re.I)),
              ("quant", re.compile(r"quant|fp8|e4m3|segmented_max_reduction|triton_\w*amax", re.I)))


def category(name: str) -> str:
    """The category of a kernel or op name: attention, gemm, quant or other_kernels."""
    return next((c for c, pattern in CATEGORIES if pattern.search(name)), "other_kernels")


def categorize(rows, wall_s: float, images: int) -> dict:
    """Seconds per image by category of profiler rows (name, own seconds: a kernel's or an op's self time; the phase
    ranges of PHASES, whose time is their total, are left out) over calls of `wall_s` seconds in all that made
    `images` images; idle_gaps_s the wall time no row covers."""
    out = {"attention_s": 0.0, "gemm_s": 0.0, "quant_s": 0.0, "other_kernels_s": 0.0}
    for name, seconds in rows:
        if name not in PHASES:
            out[f"{category(name)}_s"] += seconds
    out["idle_gaps_s"] = max(0.0, wall_s - sum(out.values()))
    return {k: v / images for k, v in out.items()}


def top_rows(rows, images: int, n: int = 15) -> list[dict]:
    """The `n` rows of most own time (phase ranges left out): {"name" (first 160 characters), "category",
    "s_per_image"}, largest first: what the categories' sums are made of."""
    kept = sorted(((name, sec) for name, sec in rows if name not in PHASES), key=lambda r: -r[1])[:n]
    return [{"name": name[:160], "category": category(name), "s_per_image": sec / images} for name, sec in kept]


class WorkerProfiler:
    """vLLM-Omni's profiler, in its diffusion workers: `PipelineProfiler`'s calls through the engine (CUDA kernels
    with `cuda`, else CPU ops)."""

    def __init__(self, engine, cuda: bool = True):
        self.engine, self.cuda = engine, cuda

    def start(self) -> None:
        self.engine.profile_start(cuda=self.cuda)

    def stop(self) -> dict:
        return self.engine.profile_stop()


def profile(engine, prompts: list[str], n: int, sampling: dict, calls: int, profiler,
            unprofiled=None) -> tuple[dict, list[dict]]:
    """(figures, top kernels: `top_rows`) of `calls` calls of `engine.generate` after a warm-up one of each setting;
    `profiler` records the profiled calls where the pipeline runs (`start()`, `stop()` -> `PipelineProfiler.stop`'s
    table). Beside the profiled wall_s, the same calls' unprofiled wall (unprofiled_wall_s) and without CFG
    (no_cfg_wall_s), per image: the profiler's own overhead shows as wall_s - unprofiled_wall_s. `unprofiled(timings)`
    gets those before the profiler starts, so a profiler that never stops still leaves them."""
    def timed(settings: dict) -> float:  # the engine returns host arrays: its work is done when it returns
        start = time.perf_counter()
        for c in range(calls):
            engine.generate(prompts, n, settings, seeds=list(range(c * len(prompts) * n, (c + 1) * len(prompts) * n)))
        return time.perf_counter() - start

    plain = {**sampling, "true_cfg_scale": 1.0}
    for settings in (sampling, plain):  # warm-up: allocations, autotuning, each path once
        engine.generate(prompts, n, settings, seeds=list(range(len(prompts) * n)))
    cfg_wall, plain_wall = timed(sampling), timed(plain)  # unprofiled, both alike
    images = calls * len(prompts) * n
    timings = {"cfg_overhead_s": (cfg_wall - plain_wall) / images, "unprofiled_wall_s": cfg_wall / images,
               "no_cfg_wall_s": plain_wall / images, "images": images}
    if unprofiled:
        unprofiled(timings)
    profiler.start()
    wall = timed(sampling)
    table = profiler.stop()
    phases = {k: v / images for k, v in table["phases"].items()}
    figures = categorize(table["rows"], wall, images)
    figures.update(text_encoder_s=phases.get("text_encoder", 0.0), vae_decode_s=phases.get("vae_decode", 0.0),
                   denoise_s=phases.get("sample", 0.0) - phases.get("text_encoder", 0.0)
                   - phases.get("vae_decode", 0.0),
                   trajectory_export_s=max(0.0, wall / images - phases.get("sample", 0.0)), wall_s=wall / images,
                   **timings)
    return figures, top_rows(table["rows"], images)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], usage=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--engine", choices=("diffusers", "vllm_omni"), default="diffusers",
                   help="vllm_omni: profiled in its workers, on a GPU")
    p.add_argument("--model", help="a folder of the default family's model, or tiny (default its recipe's random folder)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--prompts", type=int, default=2, choices=range(1, len(PROMPTS) + 1))
    p.add_argument("--n", type=int, default=4, help="images per prompt")
    p.add_argument("--size", type=int, default=TRAIN_SETTINGS["height"])
    p.add_argument("--steps", type=int, default=TRAIN_SETTINGS["num_inference_steps"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora-rank", type=int, default=0, help="bind a random adapter of this rank (0: none)")
    p.add_argument("--lora-apply", choices=("layers", "merged"), help="how the engine serves it (its default)")
    p.add_argument("--quantization", choices=("none", "fp8"), default="none", help="fp8: vLLM-Omni's DiT in FP8")
    p.add_argument("--cfg-forward", choices=CFG_FORWARDS,
                   help="true CFG's rows in one padded forward or two (default: the recipe's rollout.cfg_forward)")
    return p


@functools.cache
def recipe_cfg_forward() -> str:
    """The recipe's rollout.cfg_forward: what the profile runs unless --cfg-forward says otherwise."""
    from jaxflow.config.recipes import base

    return base().rollout.cfg_forward


def refusal(args) -> str | None:
    """The one-line error for options that cannot run together, or None."""
    if args.engine == "vllm_omni" and args.device == "cpu":
        return ("--engine vllm_omni runs its workers on a GPU: drop --device cpu, or profile --engine diffusers on "
                "the CPU")
    if args.quantization != "none" and args.engine != "vllm_omni":
        return f"--quantization {args.quantization} quantizes vLLM-Omni's DiT: add --engine vllm_omni"
    if args.quantization != "none" and (not args.lora_rank or args.lora_apply == "merged"):
        return (f"--quantization {args.quantization} serves the LoRA as layers (vLLM-Omni 0.20 serves no FP8 DiT "
                f"without one): add --lora-rank 64 and drop --lora-apply merged")
    if args.lora_apply and not args.lora_rank:
        return "--lora-apply needs an adapter to serve: add --lora-rank 64"
    return None


def result_name(args) -> str:
    """rollout_profile, with the variant's options: _fp8, _lora64, _merged, and _batched (a cfg_forward other than
    the recipe's)."""
    return "rollout_profile" + "".join(
        part for part, on in ((f"_{args.quantization}", args.quantization != "none"),
                              (f"_lora{args.lora_rank}", args.lora_rank), (f"_{args.lora_apply}", args.lora_apply),
                              (f"_{args.cfg_forward}", args.cfg_forward not in (None, recipe_cfg_forward())))
        if on)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    refused = refusal(args)
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    from jaxflow_bridge.engines import families
    from jaxflow_bridge.rollout.server import engine_class

    model = args.model or families.spec(families.DEFAULT).E2E["folder"]
    if args.model is None and not (Path(model) / families.spec(families.DEFAULT).E2E["marker"]).is_file():
        writer = families.spec(families.DEFAULT).E2E["writer"]
        subprocess.run([sys.executable, writer[0], "--out", model, *writer[1:]], check=True)
    cfg_forward = args.cfg_forward or recipe_cfg_forward()
    config = {"engine": args.engine, "model": model, "device": args.device,
              "dtype": "bfloat16" if args.device == "cuda" else "float32", "random_seed": args.seed,
              "cfg_forward": cfg_forward,
              **({"quantization": args.quantization, "lora_apply": "layers"} if args.quantization != "none" else {}),
              **({"lora_apply": args.lora_apply} if args.lora_apply else {})}
    try:
        engine = engine_class(config)(config)
    except ValueError as e:  # the engine's refusal of the model or its settings
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.lora_rank:
        folder = families.module(families.DEFAULT, "diffusers_pipeline").tiny_folder() if model == "tiny" else model
        shared = SharedAdapterFile(config["dtype"])
        manifest = shared.write_arrays(random_adapter(Path(folder), args.lora_rank, args.seed))
        try:
            ack = engine.update_lora_shared(manifest, 1, {"r": args.lora_rank, "lora_alpha": 2 * args.lora_rank,
                                                          "target_modules": list(TARGETS)})
        finally:
            shared.close()
        print(f"a random rank-{args.lora_rank} adapter bound to {ack['bound_modules']} modules", flush=True)
    window = (0, max(1, min(TRAIN_SETTINGS["sde_window_range"][1], args.steps - 1)))
    sampling = {**TRAIN_SETTINGS, "height": args.size, "width": args.size, "num_inference_steps": args.steps,
                "sde_window_size": min(TRAIN_SETTINGS["sde_window_size"], window[1]), "sde_window_range": window}
    profiler = (WorkerProfiler(engine) if args.engine == "vllm_omni" else
                PipelineProfiler(engine.pipeline, cuda=engine.device.type == "cuda"))
    name = result_name(args)
    extra = {"engine": args.engine, "model": model, "lora_rank": args.lora_rank,
             "lora_apply": args.lora_apply or "the engine's default", "quantization": args.quantization,
             "cfg_forward": cfg_forward}
    try:  # the unprofiled timings first, marked partial: the whole file replaces them
        figures, top = profile(engine, PROMPTS[:args.prompts], args.n, sampling, args.calls, profiler,
                               unprofiled=lambda timings: write_result(args.out, name, timings,
                                                                       extra={**extra, "partial": True}))
    finally:
        if args.engine == "vllm_omni":
            engine.close()
    print(write_result(args.out, name, figures, extra={**extra, "top_kernels": top}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
