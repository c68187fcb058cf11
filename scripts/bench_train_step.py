"""FlowGRPO LoRA train step, JAX (jaxflow) vs torch (diffusers + PEFT), one script run; and the LoRA sync cost.

    python scripts/bench_train_step.py --out DIR            # full Qwen-Image size, random bf16 weights
    python scripts/bench_train_step.py --tiny --out DIR     # code-path check on CPU
    python scripts/bench_train_step.py --out DIR --variant base= --variant notriton=xla_gpu_enable_triton_gemm=false
        # JAX variants (remat, scan unroll, XLA options of the step's jits) side by side, on the same weights
    python scripts/bench_train_step.py --out DIR --no-torch --txt 96 --micro 2 --variant batched= --variant split=neg=32
        # the recipe's text with the negatives in one batched call against their own forward at 32 tokens

Workload (configs/qwen_ocr.py): 512^2 (1024 image tokens) + 128 text tokens (negative prompt 8 tokens), true CFG
4 (positive and negative in one batched call), SDE window 2, LoRA r=64 on the 12 targets. Both sides take the
same batch (B samples in M micro-batches), recompute each window step's log-prob, form the clipped loss and apply
one AdamW update. Reports ms per sample-step (one window step of one sample, CFG included), model TFLOP/s, MFU;
writes OUT/train_step.json (figures of the fastest JAX variant: mfu, speedup_vs_torch, ms_per_sample_step).
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxflow.families.qwen_image.config import QwenImageConfig  # noqa: E402
from jaxflow.nn.config import ModelOptions  # noqa: E402
from jaxflow.nn.lora import LoRAParam, lora_to_peft  # noqa: E402
from jaxflow.families.qwen_image.lora import QwenImageLoRASpec
from jaxflow.families.qwen_image.transformer import QwenImageTransformer  # noqa: E402
from jaxflow.trainer.train_step import make_train_step  # noqa: E402
from jaxflow_bench.flops import DATASHEET_TFLOPS, mmdit_flops  # noqa: E402
from jaxflow_bench.results import write_result  # noqa: E402
from jaxflow_bench.timing import jax_matmul_tflops, median_ms, torch_matmul_tflops  # noqa: E402
from jaxflow_bench.workload import (FULL, ONE_UPDATE, TINY, WINDOW, add_workload_args, negatives_padded,  # noqa: E402
                                    random_model, recipe_train_config, synthetic_batch, time_steps)


def flops_per_sample_step(cfg, args) -> float:
    """One window step of one sample: the LoRA-train transformer call on positive and negative rows."""
    d = dataclasses.asdict(cfg)
    txt = max(args.txt, args.neg_txt)
    return 2 * mmdit_flops(d, args.grid ** 2, txt, args.rank)["lora_train"]


def row(framework, name, ms, cfg, args, ceiling, peak, extra=None):
    n = args.batch * len(WINDOW)
    tflops = flops_per_sample_step(cfg, args) * n / (ms / 1e3) / 1e12
    return {"framework": framework, "case": name, "ms_step": round(ms, 1), "ms_sample_step": round(ms / n, 2),
            "model_tflops": round(tflops, 1), "mfu_989": round(tflops / DATASHEET_TFLOPS, 4),
            "mfu_ceiling": round(tflops / ceiling, 4) if ceiling else None, "peak_gib": round(peak, 1),
            **(extra or {})}


def parse_variant(text: str) -> tuple[str, dict, dict]:
    """"NAME=key=val,key=val" -> (NAME, changes, XLA options): keys remat, gemm (lora_gemm), unroll (scan_unroll),
    micro (micro-batches of this variant; default --micro), neg (the negatives padded to this many tokens, the
    trainer's sample.negative_max_sequence_length: shorter than --txt they run as their own forward; default --txt,
    one batched call as the recipe runs it), stacked (1: unrolled blocks keep reading the weight stacks; by default an
    unrolled variant holds them one array per block from then on, so it comes after the scan variants) and any xla_*
    option (true/false/int/str), e.g. "notriton=xla_gpu_enable_triton_gemm=false,unroll=2"."""
    name, _, spec = text.partition("=")
    opts, xla = {}, {}
    for item in filter(None, spec.split(",")):
        key, _, val = item.partition("=")
        if key in ("remat", "gemm"):
            opts["lora_gemm" if key == "gemm" else key] = val
        elif key in ("unroll", "micro", "stacked", "neg"):
            opts["scan_unroll" if key == "unroll" else key] = int(val)
        elif key.startswith("xla_"):
            xla[key] = {"true": True, "false": False}.get(val.lower(), int(val) if val.lstrip("-").isdigit() else val)
        else:
            raise SystemExit(f"--variant {text!r}: unknown key {key!r} (remat, gemm, unroll, micro, stacked, neg or "
                             f"xla_*)")
    return name or "default", opts, xla


def bench_jax(model, cfg, args, batch, ceiling, variant):
    """One JAX variant (NAME, ModelOptions changes, XLA options) of the train step on `model`'s weights."""
    name, changes, xla = variant
    changes = dict(changes)
    micro, stacked = changes.pop("micro", args.micro), changes.pop("stacked", 0)
    batch = negatives_padded(batch, changes.pop("neg", args.txt))
    model.opts = dataclasses.replace(base_opts := model.opts, **changes)
    if model.unrolled and not stacked:
        model.unstack_blocks()
    tc = recipe_train_config((args.grid, args.grid), num_micro_batches=micro, **ONE_UPDATE)
    init_state, step = make_train_step(model, tc, compiler_options=xla)
    train_state = init_state()
    t = time.perf_counter()
    train_state, m = step(train_state, batch)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t
    ms, train_state = time_steps(step, train_state, batch, args)
    stats = jax.local_devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use", 0) / 2 ** 30
    o = model.opts
    held = " per-block weights" if model.blocks_unstacked else ""
    out = row("jax", f"{name}: remat={o.remat} gemm={o.lora_gemm} unroll={o.scan_unroll}{held} micro={micro} "
              f"{xla or ''}".strip(), ms, cfg,
              args, ceiling, peak, {"variant": name, "compile_s": round(compile_s, 1),
                                    # the first step's loss and gradient norm: variants on the same weights and
                                    # batch must agree to the compute dtype's rounding
                                    "first_loss": float(m["loss"]), "first_grad_norm": float(m["grad_norm"])})
    model.opts = base_opts
    return out, train_state, ms


def lora_export(train_state, spec) -> dict:
    """LoRA sync, trainer side: device -> host PEFT tensors (what update_lora receives)."""
    t = time.perf_counter()
    tensors = lora_to_peft(train_state.lora, spec)
    export_ms = (time.perf_counter() - t) * 1e3
    return {"lora_params": int(sum(v.size for v in tensors.values())),
            "bytes": int(sum(v.nbytes for v in tensors.values())), "export_ms": round(export_ms, 1)}


def bench_torch(cfg, args, batch, ceiling, shapes, tc):
    """The JAX step's work in torch (diffusers + PEFT): `tc`'s CFG scale, SDE, clipped loss, AdamW and grad clip."""
    import torch
    from diffusers import QwenImageTransformer2DModel
    from peft import LoraConfig, set_peft_model_state_dict

    from jaxflow_bench.torch_step import clipped_objective
    from jaxflow_bridge.rollout import sde as tsde
    from jaxflow_bridge.rollout.sampling import cfg_combine

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):
        torch.manual_seed(0)
        model = QwenImageTransformer2DModel(**{k: v for k, v in cfg.to_dict().items() if k != "_class_name"})
    model = model.to(torch.bfloat16)
    model.add_adapter(LoraConfig(r=args.rank, lora_alpha=2 * args.rank,
                                 target_modules=list(QwenImageLoRASpec().targets),
                                 init_lora_weights="gaussian"))
    lora_params = [p for n, p in model.named_parameters() if "lora_" in n]
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    model.enable_gradient_checkpointing()
    model.train()
    opt = torch.optim.AdamW(lora_params, lr=tc.learning_rate, betas=(tc.adam_b1, tc.adam_b2), eps=tc.adam_eps,
                            weight_decay=tc.weight_decay)
    t = {k: torch.from_numpy(np.ascontiguousarray(v)).to(dev) for k, v in batch.items() if k != "sigmas"}
    sigmas = torch.from_numpy(batch["sigmas"]).to(dev)
    b, m = args.batch, args.micro
    grid = [[(1, args.grid, args.grid)]] * (2 * b // m)
    length = max(args.txt, args.neg_txt)

    def pad(x, mask):
        extra = length - x.shape[1]
        return (torch.nn.functional.pad(x, (0, 0, 0, extra)), torch.nn.functional.pad(mask, (0, extra)))

    pos, pos_m = pad(t["prompt_embeds"], t["prompt_mask"])
    neg, neg_m = pad(t["negative_prompt_embeds"], t["negative_prompt_mask"])

    def step():
        for mb in range(m):
            rows = slice(mb * b // m, (mb + 1) * b // m)
            txt = torch.cat([pos[rows], neg[rows]]).to(torch.bfloat16)
            mask = torch.cat([pos_m[rows], neg_m[rows]])
            for w, idx in enumerate(WINDOW):
                x = t["latents"][rows, w]
                sig = sigmas[idx].expand(x.shape[0])
                v = model(hidden_states=torch.cat([x, x]).to(torch.bfloat16), timestep=torch.cat([sig, sig]),
                          encoder_hidden_states=txt, encoder_hidden_states_mask=mask, img_shapes=grid,
                          return_dict=False)[0].float()
                v = cfg_combine(*v.chunk(2), tc.guidance)
                _, logp, _, _ = tsde.sde_step(x, v, sig, sigmas[idx + 1].expand_as(sig), sigmas[1],
                                              sde_type=tc.sde_type, noise_level=1.2,
                                              prev_sample=t["latents"][rows, w + 1])
                terms, _ = clipped_objective(logp, t["log_probs"][rows, w], t["advantages"][rows], tc.clip_range,
                                             tc.adv_clip)
                loss = terms.mean()
                (loss / (m * len(WINDOW))).backward()
        torch.nn.utils.clip_grad_norm_(lora_params, tc.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    sync = (lambda r: torch.cuda.synchronize()) if dev == "cuda" else (lambda r: None)
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ms = median_ms(step, args.warmup, args.iters, sync)
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if dev == "cuda" else 0.0
    out = row("torch", "train step grad-ckpt", ms, cfg, args, ceiling, peak)
    # LoRA sync, rollout side: copy PEFT tensors (host fp32, the shapes the trainer exports) into the adapters.
    tensors = {k: torch.randn(s) for k, s in shapes.items()}
    t0 = time.perf_counter()
    set_peft_model_state_dict(model, tensors)
    sync(None)
    apply_ms = (time.perf_counter() - t0) * 1e3
    model = opt = None  # frees the weights: the closures above hold the cells, not the objects
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
    return out, apply_ms


def _peft_shapes(abstract, spec) -> dict[str, tuple[int, ...]]:
    """PEFT key -> shape without materialising the adapters."""
    from jaxflow_bridge.families.qwen_image import keymap
    state = nnx.state(abstract, LoRAParam)
    out = {}
    for e in keymap.lora_key_map(spec.targets):
        var = state
        for p in e.flax_path:
            var = var[p]
        for key in e.diffusers_keys(var.shape[0]):
            out[key] = tuple(var.shape[1:][::-1])
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(p)
    p.add_argument("--batch", type=int, default=8, help="samples per step")
    p.add_argument("--micro", type=int, default=2, help="micro-batches per step")
    p.add_argument("--remat", default="save_matmuls")
    p.add_argument("--attention", default="auto")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--variant", action="append", default=[],
                   help="JAX variant NAME=key=val,... (keys: remat, gemm, unroll, micro, stacked, xla_*), repeatable; "
                        "default: one variant 'default' with --remat; each runs in this process on the same weights")
    p.add_argument("--no-torch", action="store_true", help="JAX variants only (no speed-up figure)")
    args = p.parse_args(argv)
    variants = [parse_variant(v) for v in args.variant] or [("default", {}, {})]
    cfg = QwenImageConfig(**(TINY if args.tiny else FULL))
    if args.layers:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    args.out.mkdir(parents=True, exist_ok=True)
    n = 512 if args.tiny else 8192
    ceiling = {"jax": jax_matmul_tflops(n, args.iters), "torch": torch_matmul_tflops(n, args.iters)}
    print(f"devices {jax.devices()}; matmul ceiling TFLOP/s {ceiling}", flush=True)
    batch = synthetic_batch(cfg, args)
    spec = QwenImageLoRASpec(rank=args.rank, alpha=2.0 * args.rank)
    abstract = nnx.eval_shape(lambda: QwenImageTransformer(cfg, ModelOptions(), spec, rngs=nnx.Rngs(0)))
    shapes = _peft_shapes(abstract, spec)
    rows, trow, apply_ms = [], None, None
    tc = recipe_train_config((args.grid, args.grid), num_micro_batches=args.micro, **ONE_UPDATE)
    if not args.no_torch:  # torch first: JAX's allocator keeps what it has taken, so torch could not fit after it
        trow, apply_ms = bench_torch(cfg, args, batch, ceiling["torch"], shapes, tc)
        print(json.dumps(trow), flush=True)
        rows.append(trow)
    model, spec = random_model(cfg, args.rank, args.remat, args.attention)
    sync, jrows = None, []
    for variant in variants:
        jrow, train_state, jax_ms = bench_jax(model, cfg, args, batch, ceiling["jax"], variant)
        print(json.dumps(jrow), flush=True)
        jrows.append(jrow)
        if sync is None:
            sync = {**lora_export(train_state, spec), "step_ms": round(jax_ms, 1)}
        del train_state
        gc.collect()
    rows += jrows
    if apply_ms is not None:
        sync.update(apply_ms=round(apply_ms, 1),
                    fraction_of_train_step=round((sync["export_ms"] + apply_ms) / sync["step_ms"], 4))
    (args.out / "bench_train_step.json").write_text(json.dumps({"ceiling": ceiling, "rows": rows, "sync": sync},
                                                               indent=1))
    best = min(jrows, key=lambda r: r["ms_step"])
    figures = {"mfu": best["mfu_989"], "ms_per_sample_step": best["ms_sample_step"], "ms_step": best["ms_step"],
               "peak_gib": best["peak_gib"], "variant": best["case"],
               "speedup_vs_torch": round(trow["ms_step"] / best["ms_step"], 3) if trow else None,
               "jax_gemm_ceiling_8192": round(ceiling["jax"], 1), "torch_gemm_ceiling_8192": round(ceiling["torch"], 1)}
    write_result(args.out, "train_step", figures, extra={"rows": rows, "workload": {
        "batch": args.batch, "micro_batches": args.micro, "image_tokens": args.grid ** 2, "text_tokens": args.txt,
        "lora_rank": args.rank, "window": len(WINDOW), "guidance": tc.guidance,
        "model": "tiny" if args.tiny else "full", "layers": cfg.num_layers}})
    print(f"\n{'framework':9s} {'case':58s} {'ms/step':>8s} {'ms/s-step':>9s} {'TFLOP/s':>8s} {'MFU989':>7s} "
          f"{'peakGiB':>7s} {'compile':>7s}")
    for r in rows:
        print(f"{r['framework']:9s} {r['case'][:58]:58s} {r['ms_step']:8.1f} {r['ms_sample_step']:9.2f} "
              f"{r['model_tflops']:8.1f} {r['mfu_989']:7.1%} {r['peak_gib']:7.1f} {r.get('compile_s', 0):7.1f}")
    if trow:
        print(f"speed-up jax ({best['variant']})/torch: {trow['ms_step'] / best['ms_step']:.2f}x")
    print(f"LoRA sync r={args.rank}: {sync['lora_params'] / 1e6:.1f}M params, {sync['bytes'] / 2 ** 20:.0f} MiB fp32; "
          f"export {sync['export_ms']:.0f} ms" + (f" + apply {sync['apply_ms']:.0f} ms" if apply_ms else ""))


if __name__ == "__main__":
    main()
