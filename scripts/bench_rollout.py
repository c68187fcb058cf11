"""Rollout throughput of the diffusers engine: one batched B=n request vs n sequential B=1 requests.

    python scripts/bench_rollout.py --out DIR          # Qwen-Image transformer and VAE at full size, random bf16
    python scripts/bench_rollout.py --tiny --out DIR   # code-path check on CPU (the tiny pipeline)
    python scripts/bench_rollout.py --out DIR --name c --compile dynamic --n 16,32 --no-single
        # one variant per process (compile / attention backend / batch sizes): OUT/bench_rollout_NAME.json
    python scripts/bench_rollout.py --out DIR --collect    # the variants' table -> OUT/rollout_diffusers.json

The full-size build uses the real transformer (60 layers, d=3072) and the real VAE configs with random weights,
and a Qwen2.5-VL text encoder of the real width (3584) but 2 layers (full_size.py's "short" one: text encoding runs
once per prompt and is a small part of a rollout; the full 7B encoder is not built). Prompts use the locally built tokenizer.
Settings: 512^2, 10 steps, true CFG 4, SDE window 2 (noise 1.2), log-probs on (the training rollout).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from jaxflow_bench.flops import DATASHEET_TFLOPS, mmdit_flops
from jaxflow_bench.results import write_result
from jaxflow_bridge.families.qwen_image.spec import pixels_per_token
from jaxflow_bridge.families.qwen_image.full_size import full_size_pipeline
from jaxflow_bridge.families.qwen_image.diffusers_pipeline import RolloutPipeline
from jaxflow_bridge.rollout.sampling import SamplingParams
from jaxflow_bridge.families.qwen_image.tiny import build_pipeline

PROMPT = 'a wooden shop sign above a bakery door that reads "Fresh Bread Daily", warm morning light'


def timed(fn, sync) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def collect(out: Path) -> None:
    """Every variant's rows (OUT/bench_rollout_*.json of one session) as one table and rollout_diffusers.json,
    whose figure img_per_s is the fastest batched row."""
    rows = [dict(r, variant=path.stem.removeprefix("bench_rollout_"))
            for path in sorted(out.glob("bench_rollout_*.json")) for r in json.loads(path.read_text())["rows"]]
    if not rows:
        raise SystemExit(f"no bench_rollout_*.json under {out}")
    best = max((r for r in rows if r["case"].startswith("batched")), key=lambda r: r["img_per_s"])
    base = [r for r in rows if r["variant"] == "eager" and r["case"] == best["case"]]
    write_result(out, "rollout_diffusers", {
        "img_per_s": best["img_per_s"], "best": f"{best['variant']}: {best['case']}",
        "speedup_vs_eager_same_batch": round(best["img_per_s"] / base[0]["img_per_s"], 3) if base else None},
        command="python3 scripts/bench_rollout.py --out OUT --name NAME [variant flags] ... ; --collect",
        extra={"rows": rows})
    for r in rows:
        print(f"{r['variant']:14s} {r['case']:36s} {r['seconds']:8.2f} s {r['img_per_s']:8.3f} img/s"
              + (f" {100 * r['mfu989']:5.1f}% MFU989" if "mfu989" in r else ""))


def image_tflops(pipe, rollout: RolloutPipeline, args) -> float:
    """Model TFLOP of one image's transformer calls (jaxflow_bench/flops.py): every step runs the prompt's call and, with
    CFG, the negative prompt's; token counts from the pipeline's own text encoding. VAE and text encoder left out."""
    prompt, negative = (len(e) for e in rollout.encode([PROMPT, " "]))
    img = (args.size // pixels_per_token(pipe.vae.config)) ** 2
    calls = [prompt, negative] if args.cfg > 1 else [prompt]
    return args.steps * sum(mmdit_flops(dict(pipe.transformer.config), img, t)["fwd"] for t in calls) / 1e12


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--n", default="16", help="batch sizes of the batched requests, comma-separated")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--cfg", type=float, default=4.0)
    p.add_argument("--name", default="eager", help="this variant's name (OUT/bench_rollout_NAME.json)")
    p.add_argument("--compile", default="none", choices=("none", "dynamic", "static", "autotune"),
                   help="torch.compile the repeated block: dynamic shapes (rollout.compile), static shapes, or dynamic with "
                        "mode max-autotune-no-cudagraphs")
    p.add_argument("--attention", default="", help="diffusers attention backend (e.g. _native_cudnn); '' = its default")
    p.add_argument("--no-single", action="store_true", help="skip the sequential B=1 requests")
    p.add_argument("--collect", action="store_true", help="only tabulate OUT's variants")
    args = p.parse_args(argv)
    if args.collect:
        return collect(args.out)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pipe = build_pipeline() if args.tiny else full_size_pipeline(device, text_encoder="short")
    if args.attention:
        pipe.transformer.set_attention_backend(args.attention)
    if args.compile != "none":
        mode = "max-autotune-no-cudagraphs" if args.compile == "autotune" else None
        pipe.transformer.compile_repeated_blocks(dynamic=args.compile != "static", mode=mode)
    rollout = RolloutPipeline(pipe, device)
    per_image = image_tflops(pipe, rollout, args)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sp = SamplingParams(height=args.size, width=args.size, num_inference_steps=args.steps, true_cfg_scale=args.cfg,
                        max_sequence_length=512, noise_level=1.2, sde_window_size=2, sde_window_range=(0, 5))
    warm = timed(lambda: rollout.generate([PROMPT], 2, sp, seeds=[0, 1]), sync)  # warm-up (compiles)
    rows = []
    for n in (int(v) for v in args.n.split(",")):
        rollout.generate([PROMPT], n, sp, seeds=list(range(100, 100 + n)))  # this batch size's first call
        batched = timed(lambda: rollout.generate([PROMPT], n, sp, seeds=list(range(n))), sync)
        rows.append({"case": f"batched B={n} (one request)", "seconds": round(batched, 2),
                     "img_per_s": round(n / batched, 3), "tflops_per_s": round(n * per_image / batched, 1),
                     "mfu989": round(n * per_image / batched / DATASHEET_TFLOPS, 4)})
        if not args.no_single:
            single = timed(lambda: [rollout.generate([PROMPT], 1, sp, seeds=[s]) for s in range(n)], sync)
            rows.append({"case": f"{n} x B=1 (sequential requests)", "seconds": round(single, 2),
                         "img_per_s": round(n / single, 3)})
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if device == "cuda" else 0.0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"bench_rollout_{args.name}.json").write_text(json.dumps(
        {"rows": rows, "peak_gib": peak, "warmup_s": warm, "args": vars(args)}, default=str, indent=1))
    print(f"\nrollout {args.size}^2, {args.steps} steps, CFG {args.cfg}, window 2, device {device}, variant "
          f"{args.name} (compile {args.compile}, attention {args.attention or 'default'}), peak {peak:.1f} GiB, "
          f"warm-up {warm:.1f} s")
    print(f"model FLOPs per image: {per_image:.1f} TFLOP (MFU989 against the 989 TFLOP/s bf16 datasheet peak)")
    for r in rows:
        print(f"{r['case']:36s} {r['seconds']:8.2f} s {r['img_per_s']:8.3f} img/s"
              + (f" {r['tflops_per_s']:7.1f} TFLOP/s {100 * r['mfu989']:5.1f}%" if "mfu989" in r else ""))


if __name__ == "__main__":
    sys.exit(main())
