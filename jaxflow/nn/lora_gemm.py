"""One Hopper GEMM for a LoRA-adapted linear: y = x @ W + u @ V (+ bias), written once.

XLA runs an adapted linear as three GEMMs: x @ W writes the output, (x A) @ (s B) reads it back as an addend and
writes it again. This kernel adds the rank-r product and the bias to the fp32 tile before its single store, so the
output is written once and never read. The same kernel serves the backward's input gradient,
dx = dy @ W^T + (dy (s B)^T) @ A^T, with W and A read transposed in shared memory (`transposed=True`).

Built from Pallas Mosaic-GPU primitives, for H100/H200 only (jax 0.10's GPU interpreter hung on it, so it is checked
on a GPU by scripts/bench_lora_gemm.py against an fp32 reference):
- a CTA owns a (tile_m, 2 * tile_n) output tile; two compute warpgroups own a half each, a third streams x and W
  tiles through a `stages`-deep warp-specialized pipeline over K;
- before its K loop each compute warpgroup starts the TMA copies of its u rows, V columns and bias, which land
  while the loop runs; after the loop one more wgmma adds u @ V to the accumulator;
- CTAs are persistent (one per SM) and walk the output tiles in bands of `group_m` tile rows, so a band's W
  columns are reused from L2.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import PartitionSpec as P

SMEM_BYTES = 227 * 1024  # usable shared memory per block on H100/H200
_SWIZZLE = 128  # bytes: one 64-wide bf16 row segment
_SEMANTICS = {"warpgroup": plgpu.LoweringSemantics.Warpgroup, "lane": plgpu.LoweringSemantics.Lane}


@dataclasses.dataclass(frozen=True)
class Tiling:
    """tile_n is per compute warpgroup (a CTA covers 2 * tile_n output columns)."""
    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    stages: int = 3
    group_m: int = 8
    epi: int = 64  # the epilogue stores (epi, epi) sub-tiles
    semantics: str = "warpgroup"  # Mosaic GPU lowering: "warpgroup" (layouts inferred) or "lane"

    def __post_init__(self):
        if self.semantics not in _SEMANTICS:
            raise ValueError(f"Tiling.semantics={self.semantics!r}: use one of {sorted(_SEMANTICS)}")


def smem_bytes(t: Tiling, rank: int, itemsize: int = 2) -> int:
    """Shared memory the kernel allocates: pipeline stages, LoRA operands and bias, epilogue staging."""
    stage = (t.tile_m * t.tile_k + t.tile_k * 2 * t.tile_n) * itemsize
    lora = 2 * (t.tile_m * rank + rank * t.tile_n) * itemsize + 2 * t.tile_n * 4
    return t.stages * stage + lora + 2 * t.epi * t.epi * itemsize


def _transforms(minor_elems: int, itemsize: int):
    swizzle = min(_SWIZZLE, minor_elems * itemsize)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def tile_order(lin, m_tiles: int, n_tiles: int, group_m: int):
    """Output tile (row, column) of linear step `lin`: bands of `group_m` tile rows, column-major inside a band."""
    per_band = group_m * n_tiles
    band = lin // per_band
    rows = jnp.minimum(group_m, m_tiles - band * group_m)
    within = lin - band * per_band
    return band * group_m + within % rows, within // rows


def _row_vector(ref, semantics: str):
    """A (n,) SMEM vector to broadcast over a wgmma tile's rows: its layout is inferred ("warpgroup") or named."""
    if semantics == "warpgroup":
        return ref[...]
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(0))


def _kernel(x_g, w_g, u_g, v_g, b_g, o_g, *, t: Tiling, transposed: bool, has_bias: bool):
    m, k = x_g.shape
    n, rank = o_g.shape[1], u_g.shape[1]
    cta_n = 2 * t.tile_n
    m_tiles, n_tiles, k_steps = m // t.tile_m, n // cta_n, k // t.tile_k
    item = jnp.dtype(x_g.dtype).itemsize
    op_tr = _transforms(t.tile_k, item)
    if transposed:  # W stored (N, K), V stored (N, rank): tiles are read as their transposes
        w_spec = plgpu.BlockSpec((cta_n, t.tile_k), lambda kk: (0, kk), transforms=op_tr)
        v_shape = (2, t.tile_n, rank)
    else:
        w_spec = plgpu.BlockSpec((t.tile_k, cta_n), lambda kk: (kk, 0), transforms=_transforms(cta_n, item))
        v_shape = (2, rank, t.tile_n)
    x_spec = plgpu.BlockSpec((t.tile_m, t.tile_k), lambda kk: (0, kk), transforms=op_tr)
    rank_tr = _transforms(rank, item)
    v_tr = rank_tr if transposed else _transforms(t.tile_n, item)
    out_tr = _transforms(t.epi, jnp.dtype(o_g.dtype).itemsize)

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_steps,), memory_registers=40, in_specs=[x_spec, w_spec], wg_axis="wg",
            num_compute_wgs=2, max_concurrent_steps=t.stages, compute_context=context)

    def unused(*_, **__):
        return None

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(unused, unused).get_allocations(x_g, w_g),
        u_s=plgpu.SMEM((2, t.tile_m, rank), u_g.dtype, transforms=rank_tr),
        v_s=plgpu.SMEM(v_shape, v_g.dtype, transforms=v_tr),
        b_s=plgpu.SMEM((2, t.tile_n), b_g.dtype),
        o_s=plgpu.SMEM((2, t.epi, t.epi), o_g.dtype, transforms=out_tr),
        bar=plgpu.Barrier(num_arrivals=3 if has_bias else 2, num_barriers=2),
        collective_axes="wg",
    )
    def _scope(allocs, u_s, v_s, b_s, o_s, bar):
        wg = lax.axis_index("wg")
        wg_cols = pl.ds(wg * t.tile_n, t.tile_n)

        @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
        def _tile(info):
            mi, ni = tile_order(info.index[0], m_tiles, n_tiles, t.group_m)
            rows = pl.ds(mi * t.tile_m, t.tile_m)
            cols = pl.ds(ni * cta_n + wg * t.tile_n, t.tile_n)  # this warpgroup's output columns

            def context(run):
                plgpu.copy_gmem_to_smem(u_g.at[rows, :], u_s.at[wg], bar.at[wg])
                plgpu.copy_gmem_to_smem(v_g.at[cols, :] if transposed else v_g.at[:, cols], v_s.at[wg], bar.at[wg])
                if has_bias:
                    plgpu.copy_gmem_to_smem(b_g.at[cols], b_s.at[wg], bar.at[wg])

                @functools.partial(pl.run_scoped, acc=plgpu.ACC((t.tile_m, t.tile_n), jnp.float32))
                def _acc(acc):
                    run(acc)
                    plgpu.barrier_wait(bar.at[wg])
                    v = plgpu.transpose_ref(v_s.at[wg], (1, 0)) if transposed else v_s.at[wg]
                    plgpu.wgmma(acc, u_s.at[wg], v)
                    plgpu.wgmma_wait(0)
                    y = acc[...]
                    if has_bias:
                        bias = _row_vector(b_s.at[wg], t.semantics)
                        y = y + lax.broadcast_in_dim(bias.astype(jnp.float32), y.shape, [1])
                    y = y.astype(o_g.dtype)
                    for i in range(t.tile_m // t.epi):
                        for j in range(t.tile_n // t.epi):
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                            o_s[wg] = y[i * t.epi:(i + 1) * t.epi, j * t.epi:(j + 1) * t.epi]
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(
                                o_s.at[wg], o_g.at[rows, cols].at[pl.ds(i * t.epi, t.epi), pl.ds(j * t.epi, t.epi)])

            def mma(_, x_s, w_s, acc):
                w = plgpu.transpose_ref(w_s.at[wg_cols, :], (1, 0)) if transposed else w_s.at[:, wg_cols]
                plgpu.wgmma(acc, x_s, w)
                plgpu.wgmma_wait(0)
                return acc

            w_src = w_g.at[pl.ds(ni * cta_n, cta_n), :] if transposed else w_g.at[:, pl.ds(ni * cta_n, cta_n)]
            pipeline(mma, context)(x_g.at[rows, :], w_src, allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def check_shapes(x, w, u, v, bias, transposed: bool, t: Tiling) -> tuple[int, int, int, int]:
    """(M, K, N, rank), or a ValueError naming what does not fit the kernel."""
    m, k = x.shape
    n, kw = (w.shape if transposed else w.shape[::-1])
    rank = u.shape[1]
    vn, vr = (v.shape if transposed else v.shape[::-1])
    if kw != k or vn != n or vr != rank or u.shape[0] != m or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"lora_matmul: shapes x {x.shape}, w {w.shape}, u {u.shape}, v {v.shape}, "
                         f"bias {None if bias is None else bias.shape} do not chain (transposed={transposed})")
    if len({x.dtype, w.dtype, u.dtype, v.dtype}) != 1:
        raise ValueError(f"lora_matmul: x, w, u, v must share one dtype, got {x.dtype}, {w.dtype}, {u.dtype}, {v.dtype}")
    if m % t.tile_m or n % (2 * t.tile_n) or k % t.tile_k or rank % 16:
        raise ValueError(f"lora_matmul: M={m}, N={n}, K={k}, rank={rank} must be multiples of {t.tile_m}, "
                         f"{2 * t.tile_n}, {t.tile_k} and 16: use model.lora_gemm=xla (or shapes that tile)")
    if smem_bytes(t, rank) > SMEM_BYTES:
        raise ValueError(f"lora_matmul: tiling {t} with rank {rank} needs {smem_bytes(t, rank)} bytes of shared "
                         f"memory (> {SMEM_BYTES}): lower stages or tile sizes")
    return m, k, n, rank


def lora_matmul(x, w, u, v, bias=None, *, transposed: bool = False, tiling: Tiling = Tiling()) -> jax.Array:
    """x @ W + u @ V (+ bias) in x's dtype, accumulated in fp32 and rounded once.

    Forward (`transposed=False`): x (M, K), w (K, N), u = x A (M, r), v = s B (r, N), bias (N,).
    Input gradient (`transposed=True`): w (N, K) and v (N, r) are used as W^T and V^T, e.g. dy @ W^T + u @ A^T
    with w = W, v = A. Rows short of a whole tile are padded with zeros for the kernel and cut off after (the text
    rows of 2 samples, 2 x 96, run as 256)."""
    rows = x.shape[0]
    pad = -rows % tiling.tile_m
    if pad:  # x and u padded alike: rows that do not chain still do not, for check_shapes to name
        x, u = (jnp.pad(a, ((0, pad), (0, 0))) for a in (x, u))
    m, _, n, _ = check_shapes(x, w, u, v, bias, transposed, tiling)
    has_bias = bias is not None
    b = bias if has_bias else jnp.zeros((n,), x.dtype)
    y = _kernel_call(m, n, jnp.dtype(x.dtype).name, transposed, has_bias, tiling)(x, w, u, v, b)
    return y[:rows] if pad else y


@functools.lru_cache(maxsize=None)
def _kernel_call(m: int, n: int, dtype: str, transposed: bool, has_bias: bool, tiling: Tiling):
    """One jitted kernel per configuration: a model's many identical linears (60 unrolled blocks) then lower to
    one function, not one kernel lowering per call."""
    return jax.jit(plgpu.kernel(
        functools.partial(_kernel, t=tiling, transposed=transposed, has_bias=has_bias),
        out_type=jax.ShapeDtypeStruct((m, n), dtype), grid=(jax.devices()[0].core_count,), grid_names=("sm",),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=_SEMANTICS[tiling.semantics])))


def on_hopper() -> bool:
    """Whether the default device is an H100/H200 GPU (the kernel's wgmma and TMA)."""
    return jax.default_backend() == "gpu" and any(h in jax.devices()[0].device_kind for h in ("H100", "H200"))


def check_available(dtype: str) -> None:
    """Raise a one-line ValueError unless model.lora_gemm=pallas can run here: bf16 compute on H100/H200s."""
    if not on_hopper() or dtype != "bfloat16":
        raise ValueError(f"model.lora_gemm=pallas needs bf16 compute on an H100/H200 (got {dtype} on "
                         f"{jax.devices()[0].device_kind}); use model.lora_gemm=xla")


def check_partitioned(rows_split: bool) -> None:
    """Raise a one-line ValueError where the kernel would run on several devices without its rows split
    (`split_rows`): the kernel itself is not partitioned."""
    if jax.device_count() > 1 and not rows_split:
        raise ValueError(f"model.lora_gemm=pallas on {jax.device_count()} devices needs its rows split over the "
                         f"batch's devices (the trainer does so under data parallelism); use model.lora_gemm=xla")


def split_rows(matmul, mesh, axes: tuple[str, ...]):
    """`matmul` (lora_matmul's signature) run by every device on its own rows of x and u, split over the mesh
    `axes` (the batch's), with w, v and the bias whole on each: the fused kernel under data parallelism, where a
    linear's rows are the batch's samples x tokens. Its LoRA gradients stay XLA's (partitioned as any GEMM)."""
    rows = P(axes if len(axes) > 1 else axes[0])

    def run(x, w, u, v, bias=None, *, transposed: bool = False):
        def local(x, w, u, v, *bias):
            return matmul(x, w, u, v, *bias, transposed=transposed)

        whole = (P(),) * (bias is not None)
        return jax.shard_map(local, mesh=mesh, in_specs=(rows, P(), rows, P(), *whole), out_specs=rows,
                             check_vma=False)(x, w, u, v, *((bias,) if bias is not None else ()))

    return run


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def lora_linear(x, w, bias, a, b, matmul=lora_matmul):
    """x @ w + bias + (x @ a) @ b for 2-D x, every term in x's dtype (b already carries the LoRA scale).

    `matmul` (lora_matmul's signature) runs the forward and the input gradient dx = g w^T + (g b^T) a^T as one fused
    GEMM each; the LoRA gradients are XLA's rank-r GEMMs. w and bias are frozen: their cotangents are zero."""
    return matmul(x, w, x @ a, b, bias)


def _lora_linear_fwd(x, w, bias, a, b, matmul):
    u = x @ a
    return matmul(x, w, u, b, bias), (x, w, a, b, u)


def _lora_linear_bwd(matmul, res, g):
    x, w, a, b, u = res
    gb = g @ b.T
    dx = matmul(g, w, gb, a, transposed=True)
    return dx, None, None, x.T @ gb, u.T @ g


lora_linear.defvjp(_lora_linear_fwd, _lora_linear_bwd)
