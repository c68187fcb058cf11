"""JAX's Pallas Mosaic-GPU Hopper matmul against XLA's dot at the train step's GEMM shapes, bf16.

    python3 scripts/bench_pallas_gemm.py --out DIR          # on an H100/H200; writes DIR/pallas_gemm.json
    python3 scripts/bench_pallas_gemm.py --tiny --out DIR   # code-path check on CPU (XLA only, small shapes)

The question it answers: would a custom GEMM kernel (one that also folds in the LoRA terms, which XLA leaves to
separate memory-bound GEMMs) lose on the full-size GEMM itself? The kernel is `hopper_matmul_mgpu` as shipped in
jax.experimental.pallas.ops.gpu, at a few tilings. Columns (TFLOP/s; timed as scripts/gemm_ceiling.py times JAX:
LOOP calls per jit as a lax.scan over a stack of A, best of REPEATS):
- xla: `a @ b` at XLA's default flags; xla+c: `a @ b + c` (a full-size addend);
- xla_notriton: the recipe's flag (xla_gpu_enable_triton_gemm=false); xla_bT_notriton: `a @ w.T` with w stored
  (N, K), the orientation of the backward's input gradient;
- pK, pK+c: the Pallas kernel at tiling K, without and with its fused addend c.
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from jaxflow_bench.cli import bench_parser
from jaxflow_bench.results import write_result
from jaxflow_bench.timing import LOOP, best_seconds, looped

SHAPES = ((9216, 3072, 12288), (9216, 12288, 3072), (9216, 3072, 3072))
TINY_SHAPES = ((64, 32, 128),)
NOTRITON = {"xla_gpu_enable_triton_gemm": False}
# (tile_m, tile_n, tile_k, max_concurrent_steps, grid_minor_dim, grid_tile_width, wg_dimension, cluster_dimension)
TILINGS = ((128, 128, 64, 4, "N", 8, "N", None), (128, 128, 64, 4, "M", 8, "N", None),
           (128, 128, 64, 4, "M", 16, "N", None), (128, 128, 64, 4, "N", 8, "N", "M"),
           (128, 128, 64, 4, "M", 8, "N", "N"))


def pallas_matmuls():
    """[(name, matmul(a, b, c))] for each tiling, or a reason why none can run here."""
    kind = jax.devices()[0].device_kind
    if jax.default_backend() != "gpu" or not any(h in kind for h in ("H100", "H200")):
        return f"the Hopper kernel needs an H100 or H200 ({kind} here)"
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    dims = {"M": hm.MatmulDimension.M, "N": hm.MatmulDimension.N, None: None}
    out = []
    for i, (tm, tn, tk, steps, minor, width, wg, cluster) in enumerate(TILINGS):
        config = hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=tk, max_concurrent_steps=steps,
                                 grid_minor_dim=dims[minor], grid_tile_width=width, wg_dimension=dims[wg],
                                 cluster_dimension=dims[cluster])
        out.append((f"p{i}", lambda a, b, c, config=config: hm.matmul(a, b, c, config)))
    return out


def measure(m: int, k: int, n: int, loop: int = LOOP) -> dict:
    keys = jax.random.split(jax.random.key(0), 3)
    a = jax.random.normal(keys[0], (loop, m, k), jnp.bfloat16)
    b = jax.random.normal(keys[1], (k, n), jnp.bfloat16)
    c = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
    bt = jnp.asarray(b.T)

    def tflops(seconds):
        return 2 * m * k * n * loop / seconds / 1e12

    mm = looped(lambda x, b: x @ b)
    row = {"xla": tflops(best_seconds(mm, a, b)),
           "xla+c": tflops(best_seconds(looped(lambda x, b, c: x @ b + c), a, b, c)),
           "xla_notriton": tflops(best_seconds(mm.lower(a, b).compile(NOTRITON), a, b)),
           "xla_bT_notriton": tflops(best_seconds(looped(lambda x, bt: x @ bt.T).lower(a, bt).compile(NOTRITON),
                                                  a, bt))}
    kernels = pallas_matmuls()
    if isinstance(kernels, str):
        print(f"pallas: skipped, {kernels}")
        return row
    ref = jnp.matmul(a[0].astype(jnp.float32), b.astype(jnp.float32), precision="highest")
    for name, matmul in kernels:
        try:
            f = looped(lambda x, b, matmul=matmul: matmul(x, b, None))
            err = jnp.max(jnp.abs(f(a, b)[0].astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref))
            if not err < 2 ** -7:  # bf16 output rounding: at most 2^-9 of the largest entry
                raise AssertionError(f"relative error {float(err):.3g}")
            row[name] = tflops(best_seconds(f, a, b))
            row[name + "+c"] = tflops(best_seconds(looped(lambda x, b, c, matmul=matmul: matmul(x, b, c)), a, b, c))
        except (ValueError, AssertionError) as e:  # a tiling over the shared memory, or a wrong result
            print(f"{name} at {m}x{k}x{n}: {type(e).__name__}: {str(e)[:200]}")
    return row


def main(argv=None) -> int:
    p = bench_parser(__doc__, tiny=True)
    args = p.parse_args(argv)
    rows = {"x".join(map(str, s)): measure(*s, loop=2 if args.tiny else LOOP)
            for s in (TINY_SHAPES if args.tiny else SHAPES)}
    columns = list(dict.fromkeys(k for r in rows.values() for k in r))
    print(f"{'shape (MxKxN)':>16s} " + " ".join(f"{c:>8s}" for c in columns) + "  (TFLOP/s)")
    for shape, r in rows.items():
        print(f"{shape:>16s} " + " ".join(f"{r[c]:8.1f}" if c in r else f"{'-':>8s}" for c in columns))
    figures = {f"{c}_{shape}": r[c] for shape, r in rows.items() for c in r}
    print(write_result(args.out, "pallas_gemm", figures, extra={"tilings": [list(t) for t in TILINGS]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
