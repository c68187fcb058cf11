"""bf16 GEMM ceiling of JAX and torch at Qwen-Image's own shapes, measured without dispatch in the timing.

    python3 scripts/gemm_ceiling.py --out DIR          # on a GPU; writes DIR/gemm_ceiling.json
    python3 scripts/gemm_ceiling.py --tiny --out DIR   # code-path check on CPU (small shapes)

Each timed call runs LOOP matmuls back to back on distinct random-normal operands (JAX: one jit with a lax.scan
over a stack of A's, so nothing is hoisted or cached and the host dispatches once; torch: the same matmuls in a
Python loop between two CUDA events); the figure is the best of REPEATS calls after a warm-up. Timing one matmul per
call, as `bench_model.py` did before, charges JAX's per-call dispatch to the GEMM and under-measures its ceiling.
Shapes are (M, K, N) with M = 9216 rows (8 samples x 1152 tokens): 9216x3072x3072 the attention projections,
9216x3072x12288 the MLP in, 9216x12288x3072 the MLP out, 9216x3072x18432 the modulation (6 x 3072); and 8192^3.
"""
from __future__ import annotations

import sys

from jaxflow_bench.cli import bench_parser
from jaxflow_bench.results import write_result
from jaxflow_bench.timing import LOOP, jax_tflops, torch_tflops

SHAPES = ((8192, 8192, 8192), (9216, 3072, 12288), (9216, 12288, 3072), (9216, 3072, 3072), (9216, 3072, 18432))
TINY_SHAPES = ((64, 64, 64), (96, 32, 128))


def ceiling(shapes=SHAPES, loop: int = LOOP) -> dict:
    """{"MxKxN": {"jax": TFLOP/s, "jax_unrolled": TFLOP/s, "torch": TFLOP/s or None}} for each shape."""
    return {"x".join(map(str, s)): {"jax": jax_tflops(*s, loop=loop),
                                    "jax_unrolled": jax_tflops(*s, loop=loop, unrolled=True),
                                    "torch": torch_tflops(*s, loop=loop)} for s in shapes}


def main(argv=None) -> int:
    p = bench_parser(__doc__, tiny=True)
    args = p.parse_args(argv)
    rows = ceiling(TINY_SHAPES if args.tiny else SHAPES, loop=2 if args.tiny else LOOP)
    print(f"{'shape (MxKxN)':>18s} {'jax scan':>9s} {'jax unrolled':>13s} {'torch':>7s}  (TFLOP/s)")
    for shape, r in rows.items():
        torch_s = f"{r['torch']:7.1f}" if r["torch"] is not None else f"{'-':>7s}"
        print(f"{shape:>18s} {r['jax']:9.1f} {r['jax_unrolled']:13.1f} {torch_s}")
    figures = {f"{fw}_{shape}": r[fw] for shape, r in rows.items() for fw in ("jax", "jax_unrolled", "torch")
               if r[fw] is not None}
    print(write_result(args.out, "gemm_ceiling", figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
