"""vLLM-Omni vs diffusers rollout at full Qwen-Image size (random weights), one process, one GPU, one run.

    python3 scripts/bench_rollout_engines.py --out DIR [--model DIR] [--skip-lora]

Tables (each row: images / wall seconds of the timed call, after an untimed warm-up call of the same shape):
1. "seed": 512^2, 50 steps, no CFG (ODE), 2 prompts x 16 images: vLLM-Omni batched (one request per prompt,
   16 outputs), vLLM-Omni 16 concurrent single-image requests, the diffusers engine batched (the same 2 x 16).
2. "train": the same three with the training settings: 10 steps, true CFG 4, SDE window 2 (noise 1.2), log-probs
   and window latents returned.
Both engines run our FlowGRPO pipeline (the same loop); vLLM-Omni's transformer is its own (fused QKV, its
attention backend, torch.compile unless --eager). Between the engines vLLM-Omni sleeps (level 1): the freed
memory and the wake time are reported.
3. LoRA (vLLM-Omni, unless --skip-lora): a random r=64 adapter on the 12 targets is applied (timed), images change;
   a bad adapter (a wrong shape) is refused and the previous one keeps serving (same images, bit for bit).
Writes DIR/rollout_seed_table.json and DIR/lora_vllm_omni_check.json. Needs `if __name__ == "__main__"` (vLLM-Omni
spawns workers).
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from jaxflow_bench.cli import bench_parser
from jaxflow_bench.results import write_result
from jaxflow_bench.rollout import PROMPTS, SEED_SETTINGS, TARGETS, TRAIN_SETTINGS, random_adapter


def timed_rows(engine, sampling: dict, n: int) -> dict:
    """img/s of one batched call (len(PROMPTS) prompts x n) and, on vLLM-Omni, of n concurrent single-image
    requests; each timed call follows a short untimed one of the same shapes (compilation, autotuning)."""
    rows, warm = {}, {**sampling, "num_inference_steps": min(sampling["num_inference_steps"], 6)}
    for label, prompts, per in (("batched", PROMPTS, n), ("concurrent", [PROMPTS[i % 2] for i in range(n)], 1)):
        if label == "concurrent" and engine.name != "vllm_omni":
            continue  # the diffusers actor serves one call at a time: concurrency is sequential there
        engine.generate(prompts[:1] if per == 1 else prompts, per, warm, 0)
        t = time.perf_counter()
        engine.generate(prompts, per, sampling, 1)
        rows[label] = len(prompts) * per / (time.perf_counter() - t)
        print(f"  {engine.name:9s} {label:10s} {rows[label]:.3f} img/s", flush=True)
    return rows


def lora_check(engine, model: Path) -> dict:
    sampling = dict(TRAIN_SETTINGS)
    config = {"r": 64, "lora_alpha": 64, "target_modules": list(TARGETS)}
    before = engine.generate(PROMPTS[:1], 2, sampling, 7)["images"]
    adapter = random_adapter(model, 64, 0)
    t = time.perf_counter()
    ack = engine.update_lora(adapter, 1, config)
    apply_s = time.perf_counter() - t
    after = engine.generate(PROMPTS[:1], 2, sampling, 7)["images"]
    bad = dict(adapter)
    key = next(k for k in bad if k.endswith("lora_A.weight"))
    bad[key] = bad[key][:, :-1]
    try:
        engine.update_lora(bad, 2, config)
        refused = False
    except (ValueError, RuntimeError) as e:
        refused, message = True, str(e).splitlines()[0][:200]
    still = engine.generate(PROMPTS[:1], 2, sampling, 7)["images"]
    figures = {"bound_modules": ack["bound_modules"], "version_acked": ack["version"], "apply_s": apply_s,
               "adapter_mib": sum(v.nbytes for v in adapter.values()) / 2 ** 20,
               "images_changed": bool(np.any(before != after)), "bad_adapter_refused": refused,
               "old_adapter_still_serving": bool(np.array_equal(after, still)),
               "policy_version_after_refusal": engine.info()["policy_version"]}
    print("  LoRA:", figures, "|", message if refused else "NOT refused", flush=True)
    return figures


def main(argv=None) -> int:
    p = bench_parser(__doc__)
    p.add_argument("--model", type=Path, default=Path("/tmp/qwen_random"))
    p.add_argument("--seed", type=int, default=0, help="random-weights seed")
    p.add_argument("--eager", action="store_true", help="vLLM-Omni without torch.compile")
    p.add_argument("--skip-lora", action="store_true")
    p.add_argument("--tables", default="seed,train", help="which tables: seed, train or both (one call each fits "
                                                          "a 10-minute limit better)")
    args = p.parse_args(argv)
    if not (args.model / "model_index.json").exists():
        subprocess.run([sys.executable, str(Path(__file__).with_name("make_random_pipeline.py")), "--out",
                        str(args.model), "--no-transformer-weights"], check=True)
    import torch

    from jaxflow_bridge.rollout.server import engine_class

    def build(name: str, **extra):
        config = {"engine": name, "model": str(args.model), "dtype": "bfloat16", "random_seed": args.seed, **extra}
        t = time.perf_counter()
        engine = engine_class(config)(config)
        print(f"{name}: started in {time.perf_counter() - t:.1f} s", flush=True)
        return engine

    figures = {}
    omni = build("vllm_omni", **({"omni_args": {"enforce_eager": True}} if args.eager else {}))
    tables = [(t, SEED_SETTINGS if t == "seed" else TRAIN_SETTINGS) for t in args.tables.split(",")]
    for table, sampling in tables:
        for label, v in timed_rows(omni, sampling, 16).items():
            figures[f"omni_{label}_img_s" if table == "seed" else f"train_omni_{label}_img_s"] = v
    lora = None if args.skip_lora else lora_check(omni, args.model)
    t = time.perf_counter()
    figures["omni_sleep_freed_gib"] = omni.sleep() / 2 ** 30
    figures["omni_sleep_s"] = time.perf_counter() - t
    diffusers = build("diffusers", device="cuda")
    for table, sampling in tables:
        v = timed_rows(diffusers, sampling, 16)["batched"]
        figures["diffusers_batched_img_s" if table == "seed" else "train_diffusers_batched_img_s"] = v
    figures["omni_fingerprint_equals_diffusers"] = omni.info()["fingerprint"] == diffusers.info()["fingerprint"]
    del diffusers
    torch.cuda.empty_cache()
    t = time.perf_counter()
    omni.wake()
    figures["omni_wake_s"] = time.perf_counter() - t
    omni.generate(PROMPTS[:1], 1, TRAIN_SETTINGS, 3)  # serves again after waking
    print("\n| settings | vLLM-Omni batched | vLLM-Omni concurrent | diffusers batched |\n|---|---|---|---|")
    for table, _ in tables:
        prefix = "" if table == "seed" else "train_"
        print(f"| {table} | {figures[prefix + 'omni_batched_img_s']:.3f} | "
              f"{figures[prefix + 'omni_concurrent_img_s']:.3f} | {figures[prefix + 'diffusers_batched_img_s']:.3f} |")
    print({k: v for k, v in figures.items() if "img_s" not in k})
    write_result(args.out, "rollout_seed_table" if args.tables == "seed,train" else f"rollout_{args.tables}_table",
                 figures)
    if lora is not None:
        write_result(args.out, "lora_vllm_omni_check", lora)
    return 0


if __name__ == "__main__":
    sys.exit(main())
