"""How the benchmarks time: the best of REPEATS jitted calls (`best_seconds`), LOOP calls in one jit (`looped`), the
median of a step after warm-up (`median_ms`), the bf16 GEMM ceiling of JAX and torch (scripts/gemm_ceiling.py), and
JAX's peak memory. JAX is imported here; torch only inside `torch_tflops`.
"""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

LOOP, REPEATS = 20, 5


def best_seconds(f, *args, repeats: int = REPEATS) -> float:
    """Best wall time of f(*args) over `repeats` calls after one warm-up (compilation) call."""
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t)
    return best


def looped(fn):
    """jit of a lax.scan applying fn(x, *rest) to each x of a stacked first argument."""
    return jax.jit(lambda a, *rest: jax.lax.scan(lambda s, x: (s, fn(x, *rest)), 0, a)[1])


def jax_tflops(m: int, k: int, n: int, loop: int = LOOP, repeats: int = REPEATS, unrolled: bool = False) -> float:
    """`unrolled`: the LOOP matmuls written out in one jit on LOOP separate operands (no while loop, no slicing);
    otherwise a lax.scan over one stacked operand."""
    a = jax.random.normal(jax.random.key(0), (loop, m, k), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (k, n), jnp.bfloat16)
    if unrolled:
        a = [a[i] for i in range(loop)]
        f = jax.jit(lambda a, b: [x @ b for x in a])
    else:
        f = looped(lambda x, b: x @ b)
    return 2 * m * k * n * loop / best_seconds(f, a, b, repeats=repeats) / 1e12


def torch_tflops(m: int, k: int, n: int, loop: int = LOOP, repeats: int = REPEATS) -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    a = torch.randn(loop, m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(loop, m, n, device="cuda", dtype=torch.bfloat16)

    def run():
        for i in range(loop):
            torch.matmul(a[i], b, out=out[i])

    run()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * m * k * n * loop / best / 1e12


def median_ms(fn, warmup: int, iters: int, sync) -> float:
    for _ in range(warmup):
        sync(fn())
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        sync(fn())
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def jax_matmul_tflops(n: int, iters: int) -> float:
    """The bf16 n^3 GEMM ceiling, dispatch excluded (`jax_tflops`; best of `iters` loops of 20)."""
    return jax_tflops(n, n, n, repeats=iters)


def torch_matmul_tflops(n: int, iters: int) -> float:
    return torch_tflops(n, n, n, repeats=iters) or 0.0


def jax_peak_gib() -> float:
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use", 0) / 2 ** 30
