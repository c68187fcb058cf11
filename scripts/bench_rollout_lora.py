"""vLLM-Omni's rollout with the recipe's r=64 LoRA bound: its own per-slice LoRA apply against our fused op.

    python3 scripts/bench_rollout_lora.py --out DIR [--model DIR] [--modes stock,fused,fused+split,fused+sdpa]

For each mode (`lora_apply` of the vllm_omni engine, then options: "+split" the engine's cfg_forward="split", true
CFG's rows in two forwards; "+sdpa" vLLM-Omni's attention backend TORCH_SDPA instead of its default; "+vllmqk" the
engine's qk_ops="vllm", vLLM-Omni's own q/k norm and rotary kernels instead of ours; "+fa2" the engine's
fa_version="2", FlashAttention as vLLM-Omni picks it (FA2 without a FlashAttention package); one engine after
the other, each in its own process, torch's graph-break and recompile logs on): the recipe's rollout settings (512^2, 10 steps,
CFG 4, SDE window 2), 2 prompts x 16 images, img/s of one timed call after a warm-up call, first without a LoRA,
then with a random r=64 adapter on the 12 targets bound. The first request of one more LoRA'd call, after the timed
ones (the profiler slows what it traces), is traced (torch.profiler in the worker, `vllm_omni_pipeline.TRACE_ENV`)
and broken down by kernel class as
scripts/profile_step.py does. Writes DIR/rollout_lora_vllm_omni.json (figures `<mode>_base_img_s`,
`<mode>_lora_img_s`, `<mode>_lora_s` = the seconds the LoRA adds to the 32 images, `<mode>_share_<class>` and
`<mode>_kernel_busy` of the traced request, and `fused_over_stock`, `split_over_batched` of the LoRA'd rollouts); each mode's top kernels
go to DIR/kernels_<mode>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from jaxflow_bench.cli import bench_parser
from jaxflow_bench.kernels import breakdown, gpu_kernels
from jaxflow_bench.results import write_result
from jaxflow_bench.rollout import PROMPTS, TARGETS, TRAIN_SETTINGS, random_adapter

# 2 prompts a call: base warm-up, base timed, LoRA warm-up, LoRA timed, then the traced call (not timed)
TRACED_REQUEST = 9


def one_mode(model: Path, mode: str, seed: int) -> dict:
    from jaxflow_bridge.rollout.server import engine_class

    lora_apply, *options = mode.split("+")
    config = {"engine": "vllm_omni", "model": str(model), "dtype": "bfloat16", "random_seed": seed,
              "lora_apply": lora_apply, "cfg_forward": "split" if "split" in options else "batched",
              "qk_ops": "vllm" if "vllmqk" in options else "compiled", "fa_version": "2" if "fa2" in options else "auto"}
    engine = engine_class(config)(config)

    def img_s() -> float:
        engine.generate(PROMPTS, 16, TRAIN_SETTINGS, 0)  # warm-up: compilation for this LoRA state
        t = time.perf_counter()
        engine.generate(PROMPTS, 16, TRAIN_SETTINGS, 1)
        return 32 / (time.perf_counter() - t)

    row = {"base_img_s": img_s()}
    ack = engine.update_lora(random_adapter(model, 64, 0), 1,
                             {"r": 64, "lora_alpha": 128, "target_modules": list(TARGETS)})
    row.update(lora_img_s=img_s(), bound_modules=ack["bound_modules"])
    engine.generate(PROMPTS, 16, TRAIN_SETTINGS, 2)  # traced (TRACED_REQUEST)
    row["lora_s"] = 32 / row["lora_img_s"] - 32 / row["base_img_s"]
    return row


def main(argv=None) -> int:
    p = bench_parser(__doc__)
    p.add_argument("--model", type=Path, default=Path("/tmp/qwen_random"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="stock,fused")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one mode, print its row as JSON
    args = p.parse_args(argv)
    if args.one:
        print("ROW " + json.dumps(one_mode(args.model, args.one, args.seed)), flush=True)
        return 0
    if not (args.model / "model_index.json").exists():
        subprocess.run([sys.executable, str(Path(__file__).with_name("make_random_pipeline.py")), "--out",
                        str(args.model), "--no-transformer-weights"], check=True)
    figures = {}
    for mode in args.modes.split(","):
        trace = args.out / f"trace_{mode}"
        env = {**os.environ, "JAXFLOW_ROLLOUT_TRACE": str(trace), "JAXFLOW_ROLLOUT_TRACE_AT": str(TRACED_REQUEST),
               "TORCH_LOGS": "graph_breaks,recompiles"}
        if "sdpa" in mode.split("+"):
            env["DIFFUSION_ATTENTION_BACKEND"] = "TORCH_SDPA"
        run = subprocess.run([sys.executable, __file__, "--out", str(args.out), "--model", str(args.model),
                              "--seed", str(args.seed), "--one", mode], capture_output=True, text=True, env=env)
        (args.out / f"rollout_lora_{mode}.log").parent.mkdir(parents=True, exist_ok=True)
        (args.out / f"rollout_lora_{mode}.log").write_text(run.stdout + run.stderr)
        rows = [line[4:] for line in run.stdout.splitlines() if line.startswith("ROW ")]
        if run.returncode or not rows:
            print(f"{mode}: failed (exit {run.returncode}); see {args.out}/rollout_lora_{mode}.log", flush=True)
            print("\n".join((run.stdout + run.stderr).splitlines()[-15:]))
            return 1
        for k, v in json.loads(rows[0]).items():
            figures[f"{mode}_{k}"] = v
        print(mode, json.loads(rows[0]), flush=True)
        for path in sorted(trace.glob("rollout-*.json"))[:1]:
            wall = float(path.stem.rsplit("-", 1)[1].removesuffix("s"))
            r = breakdown(f"{mode}: one traced request (16 images)", gpu_kernels(json.loads(path.read_text())), wall,
                          top=40)
            (args.out / f"kernels_{mode}.json").write_text(json.dumps(r, indent=1))
            figures[f"{mode}_kernel_busy"] = r["kernel_ms"] / r["wall_ms"]
            for c, ms in r["classes"].items():
                figures[f"{mode}_share_{c}"] = ms / r["kernel_ms"]
    if "stock_lora_img_s" in figures and "fused_lora_img_s" in figures:
        figures["fused_over_stock"] = figures["fused_lora_img_s"] / figures["stock_lora_img_s"]
    if "fused_lora_img_s" in figures and "fused+split_lora_img_s" in figures:
        figures["split_over_batched"] = figures["fused+split_lora_img_s"] / figures["fused_lora_img_s"]
    print("| mode | img/s without LoRA | img/s with r64 LoRA | s the LoRA adds (32 images) |\n|---|---|---|---|")
    for mode in args.modes.split(","):
        print(f"| {mode} | {figures[mode + '_base_img_s']:.3f} | {figures[mode + '_lora_img_s']:.3f} | "
              f"{figures[mode + '_lora_s']:.2f} |")
    write_result(args.out, "rollout_lora_vllm_omni", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
