"""An adapted linear as XLA runs it (three GEMMs) against the fused LoRA GEMM kernel, at the train step's shapes.

    python3 scripts/bench_lora_gemm.py --out DIR          # on an H100/H200; writes DIR/lora_gemm.json
    python3 scripts/bench_lora_gemm.py --tiny --out DIR   # code-path check on CPU (XLA columns only, small shapes)

Per shape (M x K x N, rank 64, bf16) and orientation, in ms per linear (LOOP linears per jit as a lax.scan over a
stack of inputs, best of REPEATS, as scripts/gemm_ceiling.py times):
- fwd: y = x W + b + (x A)(s B). `base`: x W + b alone (the floor); `xla`: the model's Linear as written, compiled
  with the recipe's flag (xla_gpu_enable_triton_gemm=false); `fused[T]`: x A by XLA, then
  `jaxflow.nn.lora_gemm.lora_matmul` at tiling T.
- bwd: the input gradient dx = dy W^T + (dy (s B)^T) A^T, the same three ways.
Each fused output is checked against an fp32 reference (bf16 rounding: at most 2^-7 of the largest entry).
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from jaxflow.nn.lora_gemm import Tiling, lora_matmul, on_hopper
from jaxflow_bench.cli import bench_parser
from jaxflow_bench.results import write_result
from jaxflow_bench.timing import LOOP, best_seconds, looped

RANK = 64
# image stream at B=8 (8 x 1024 tokens): projections, MLP in, MLP out; text stream (8 x 128 tokens): projections
SHAPES = ((8192, 3072, 3072), (8192, 3072, 12288), (8192, 12288, 3072), (1024, 3072, 3072))
TINY_SHAPES = ((128, 128, 256),)
TILINGS = {"s3g8": Tiling(stages=3, group_m=8), "s3g8lane": Tiling(stages=3, group_m=8, semantics="lane"),
           "s3g16": Tiling(stages=3, group_m=16), "s2g8": Tiling(stages=2, group_m=8)}
NOTRITON = {"xla_gpu_enable_triton_gemm": False}


def _operands(m: int, k: int, n: int, loop: int):
    ks = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(ks[0], (loop, m, k), jnp.bfloat16)
    dy = jax.random.normal(ks[1], (loop, m, n), jnp.bfloat16)
    w = (jax.random.normal(ks[2], (k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
    a = (jax.random.normal(ks[3], (k, RANK), jnp.float32) / RANK).astype(jnp.bfloat16)
    b = (jax.random.normal(ks[4], (RANK, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
    bias = jnp.linspace(-1, 1, n, dtype=jnp.float32).astype(jnp.bfloat16)
    return x, dy, w, a, b, bias


def _rel_err(y, ref) -> float:
    return float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))


def measure(m: int, k: int, n: int, tilings: dict, loop: int) -> dict:
    x, dy, w, a, b, bias = _operands(m, k, n, loop)
    f32 = lambda t: t.astype(jnp.float32)  # noqa: E731
    hi = dict(precision="highest")
    ms = lambda s: s / loop * 1e3  # noqa: E731
    ref_fwd = jnp.matmul(f32(x[0]), f32(w), **hi) + f32(bias) + jnp.matmul(jnp.matmul(f32(x[0]), f32(a), **hi).astype(
        jnp.bfloat16).astype(jnp.float32), f32(b), **hi)
    u_bwd = jnp.matmul(f32(dy[0]), f32(b).T, **hi).astype(jnp.bfloat16).astype(jnp.float32)
    ref_bwd = jnp.matmul(f32(dy[0]), f32(w).T, **hi) + jnp.matmul(u_bwd, f32(a).T, **hi)
    cases = {
        "fwd": ((x, w, a, b, bias), lambda x, w, a, b, c: x @ w + c,
                lambda x, w, a, b, c: x @ w + c + (x @ a) @ b, ref_fwd),
        "bwd": ((dy, w, a, b), lambda g, w, a, b: g @ w.T,
                lambda g, w, a, b: g @ w.T + (g @ b.T) @ a.T, ref_bwd),
    }
    fused = {
        "fwd": lambda t: lambda x, w, a, b, c: lora_matmul(x, w, x @ a, b, c, tiling=t),
        "bwd": lambda t: lambda g, w, a, b: lora_matmul(g, w, g @ b.T, a, transposed=True, tiling=t),
    }
    def compiled(fn, args):  # the recipe's flag for every XLA GEMM, the fused cases' x A included
        f = looped(fn)
        return f.lower(*args).compile(NOTRITON) if jax.default_backend() == "gpu" else f

    row = {}
    for case, (args, base, xla, ref) in cases.items():
        for name, fn in (("base", base), ("xla", xla)):
            row[f"{case}_{name}_ms"] = ms(best_seconds(compiled(fn, args), *args))
        for tname, t in tilings.items():
            try:
                f = compiled(fused[case](t), args)
                err = _rel_err(f(*args)[0], ref)
                if not err < 2 ** -7:
                    raise AssertionError(f"relative error {err:.3g}")
                row[f"{case}_fused_{tname}_ms"] = ms(best_seconds(f, *args))
                row[f"{case}_fused_{tname}_err"] = err
            except Exception as e:  # noqa: BLE001 - a tiling that does not lower or is wrong: report, go on
                print(f"{case} {tname} at {m}x{k}x{n}: {type(e).__name__}: {str(e)[:300]}")
    return row


def main(argv=None) -> int:
    p = bench_parser(__doc__, tiny=True)
    args = p.parse_args(argv)
    kind, hopper = jax.devices()[0].device_kind, on_hopper()
    if not args.tiny and not hopper:
        raise SystemExit(f"bench_lora_gemm: the kernel needs an H100 or H200 ({kind} here); use --tiny on a CPU")
    if not hopper:
        print(f"fused: skipped, the kernel needs an H100 or H200 ({kind} here)")
    shapes, loop = (TINY_SHAPES, 2) if args.tiny else (SHAPES, LOOP)
    tilings = TILINGS if hopper else {}
    rows = {"x".join(map(str, s)): measure(*s, tilings, loop) for s in shapes}
    for shape, r in rows.items():
        print(f"== {shape} (ms per linear)")
        for case in ("fwd", "bwd"):
            cells = {k.split("_", 1)[1][:-3]: v for k, v in r.items() if k.startswith(case) and k.endswith("_ms")}
            print(f"  {case}: " + "  ".join(f"{k} {v:.3f}" for k, v in cells.items()))
    figures = {f"{k}_{shape}": v for shape, r in rows.items() for k, v in r.items()}
    print(write_result(args.out, "lora_gemm", figures, extra={
        "rank": RANK, "tilings": {k: vars(t) for k, t in tilings.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
