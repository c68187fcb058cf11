"""Qwen-Image transformer benchmark: JAX (jaxflow) vs torch (diffusers + PEFT, SDPA), one script run.

    python scripts/bench_model.py --out DIR            # full size (60 layers, d=3072), random bf16 weights
    python scripts/bench_model.py --tiny --out DIR     # code-path check on CPU

Measures the forward and the LoRA forward+backward (grads for LoRA only, remat on) at 512^2 (1024 image
tokens) + 128 text tokens: median ms/step after warm-up, model TFLOP/s and MFU by the token-active FLOP
model, compile time (JAX), peak memory; the bf16 matmul ceiling of both frameworks in the same run.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU in this process

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jaxflow.families.qwen_image.config import QwenImageConfig  # noqa: E402
from jaxflow.nn.config import ModelOptions  # noqa: E402
from jaxflow.nn.lora import LoRAParam  # noqa: E402
from jaxflow.families.qwen_image.lora import QwenImageLoRASpec
from jaxflow.families.qwen_image.transformer import QwenImageTransformer  # noqa: E402
from jaxflow_bench.flops import DATASHEET_TFLOPS, mmdit_flops  # noqa: E402
from jaxflow_bench.timing import jax_matmul_tflops, jax_peak_gib, median_ms, torch_matmul_tflops  # noqa: E402
from jaxflow_bench.workload import FULL, TINY  # noqa: E402


def bench_jax(cfg, args, rows):
    opts = ModelOptions(dtype="bfloat16", param_dtype="bfloat16", remat="none", attention=args.attention)
    spec = QwenImageLoRASpec(rank=args.rank, alpha=2.0 * args.rank)
    make = lambda o: QwenImageTransformer(cfg, o, spec, rngs=nnx.Rngs(0))  # noqa: E731
    t = time.perf_counter()
    state = jax.jit(lambda: nnx.state(make(opts)))()
    jax.block_until_ready(state)
    print(f"jax init {time.perf_counter() - t:.1f}s", flush=True)
    grid = (args.grid, args.grid)
    for batch in args.fwd_batch:
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: make(opts)))
        x, s, txt = inputs_jax(cfg, batch, args)
        fwd = jax.jit(lambda st, x, s, txt: nnx.merge(graphdef, st)(x, s, txt, None, grid))
        rows.append(run_jax(f"forward B={batch}", fwd, (state, x, s, txt), batch, "fwd", cfg, args))
    for remat in args.remat:
        o = ModelOptions(dtype="bfloat16", param_dtype="bfloat16", remat=remat, attention=args.attention)
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: make(o)))
        lora, base = nnx.split_state(state, LoRAParam, ...)

        def loss(lora, base, x, s, txt):
            out = nnx.merge(graphdef, lora, base)(x, s, txt, None, grid)
            return jnp.mean(jnp.square(out.astype(jnp.float32)))

        step = jax.jit(jax.value_and_grad(loss))
        for batch in args.batch:
            x, s, txt = inputs_jax(cfg, batch, args)
            rows.append(run_jax(f"LoRA fwd+bwd remat={remat} B={batch}", step, (lora, base, x, s, txt), batch,
                                "lora_train", cfg, args))


def inputs_jax(cfg, batch, args):
    k = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(k[0], (batch, args.grid ** 2, cfg.in_channels), jnp.float32)
    s = jax.random.uniform(k[1], (batch,), jnp.float32, 0.1, 1.0)
    txt = jax.random.normal(k[2], (batch, args.txt, cfg.joint_attention_dim), jnp.float32)
    return x, s, txt


def run_jax(name, fn, fn_args, batch, kind, cfg, args):
    t = time.perf_counter()
    compiled = fn.lower(*fn_args).compile()
    compile_s = time.perf_counter() - t
    ms = median_ms(lambda: compiled(*fn_args), args.warmup, args.iters, jax.block_until_ready)
    row = summarize("jax", name, ms, batch, kind, cfg, args, jax_peak_gib(), compile_s)
    print(json.dumps(row), flush=True)
    return row


def summarize(framework, name, ms, batch, kind, cfg, args, peak_gib, compile_s=None):
    f = mmdit_flops(dataclasses.asdict(cfg), args.grid ** 2, args.txt, args.rank)[kind]
    tflops = f * batch / (ms / 1e3) / 1e12
    return {"framework": framework, "case": name, "ms_step": round(ms, 2), "ms_sample": round(ms / batch, 2),
            "model_tflops": round(tflops, 1), "mfu_989": round(tflops / DATASHEET_TFLOPS, 4),
            "mfu_ceiling": round(tflops / args.ceiling[framework], 4) if args.ceiling.get(framework) else None,
            "peak_gib": round(peak_gib, 1), "compile_s": None if compile_s is None else round(compile_s, 1)}


def bench_torch(cfg, args, rows):
    import torch
    from diffusers import QwenImageTransformer2DModel
    from peft import LoraConfig

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    with torch.device(dev):
        torch.manual_seed(0)
        model = QwenImageTransformer2DModel(**{k: v for k, v in cfg.to_dict().items() if k != "_class_name"})
    model = model.to(dtype).eval()
    spec = QwenImageLoRASpec(rank=args.rank)
    model.add_adapter(LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=list(spec.targets),
                                 init_lora_weights="gaussian"))
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    model.enable_gradient_checkpointing()
    sync = (lambda r: torch.cuda.synchronize()) if dev == "cuda" else (lambda r: None)
    grid = (1, args.grid, args.grid)

    def inputs(batch):
        g = torch.Generator(dev).manual_seed(1)
        x = torch.randn(batch, args.grid ** 2, cfg.in_channels, device=dev, dtype=dtype, generator=g)
        txt = torch.randn(batch, args.txt, cfg.joint_attention_dim, device=dev, dtype=dtype, generator=g)
        s = torch.rand(batch, device=dev, generator=g).to(dtype)
        return dict(hidden_states=x, encoder_hidden_states=txt, timestep=s, encoder_hidden_states_mask=None,
                    img_shapes=[[grid]] * batch, return_dict=False)

    def peak():
        return torch.cuda.max_memory_allocated() / 2 ** 30 if dev == "cuda" else 0.0

    for batch in args.fwd_batch:
        kw = inputs(batch)
        torch.cuda.reset_peak_memory_stats() if dev == "cuda" else None

        def fwd():
            with torch.no_grad():
                return model(**kw)[0]
        ms = median_ms(fwd, args.warmup, args.iters, sync)
        rows.append(summarize("torch", f"forward B={batch}", ms, batch, "fwd", cfg, args, peak()))
        print(json.dumps(rows[-1]), flush=True)
    model.train()
    for batch in args.batch:
        kw = inputs(batch)
        torch.cuda.reset_peak_memory_stats() if dev == "cuda" else None

        def step():
            out = model(**kw)[0]
            loss = out.float().square().mean()
            loss.backward()
            model.zero_grad(set_to_none=True)
            return loss
        ms = median_ms(step, args.warmup, args.iters, sync)
        rows.append(summarize("torch", f"LoRA fwd+bwd grad-ckpt B={batch}", ms, batch, "lora_train", cfg, args,
                              peak()))
        print(json.dumps(rows[-1]), flush=True)
    model = None  # frees the weights: the closures above hold the cell, not the module
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()


def ints(s):
    return [int(v) for v in s.split(",") if v]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--grid", type=int, default=32, help="image token grid side (32 = 512^2)")
    p.add_argument("--txt", type=int, default=128)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--batch", type=ints, default=[2, 4, 8])
    p.add_argument("--fwd-batch", type=ints, default=[2, 8])
    p.add_argument("--remat", type=lambda s: s.split(","), default=["full"])
    p.add_argument("--attention", default="auto")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--skip-torch", action="store_true")
    args = p.parse_args(argv)
    cfg = QwenImageConfig(**(TINY if args.tiny else FULL))
    args.out.mkdir(parents=True, exist_ok=True)
    n = 512 if args.tiny else 8192
    args.ceiling = {"jax": jax_matmul_tflops(n, args.iters)}
    if not args.skip_torch:
        args.ceiling["torch"] = torch_matmul_tflops(n, args.iters)
    print(f"devices {jax.devices()}; matmul ceiling TFLOP/s {args.ceiling}", flush=True)
    rows = []
    if not args.skip_torch:
        bench_torch(cfg, args, rows)
    bench_jax(cfg, args, rows)
    (args.out / "bench_model.json").write_text(json.dumps({"ceiling": args.ceiling, "rows": rows}, indent=1))
    print(f"\n{'framework':9s} {'case':34s} {'ms/step':>8s} {'ms/sample':>9s} {'TFLOP/s':>8s} {'MFU989':>7s} "
          f"{'MFUceil':>7s} {'peakGiB':>7s} {'compile':>7s}")
    for r in rows:
        print(f"{r['framework']:9s} {r['case']:34s} {r['ms_step']:8.1f} {r['ms_sample']:9.1f} {r['model_tflops']:8.1f} "
              f"{r['mfu_989']:7.1%} {(r['mfu_ceiling'] or 0):7.1%} {r['peak_gib']:7.1f} {str(r['compile_s']):>7s}")


if __name__ == "__main__":
    main()
