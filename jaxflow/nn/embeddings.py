"""Timestep embedding and the interleaved-pair RoPE (centred image grid, text offset)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

TIMESTEP_CHANNELS = 256
_ROPE_THETA = 10000.0


# exp(-ln(10000) i / 128), i < 128, as diffusers' get_timestep_embedding forms it: the exponent in float32, then exp
# evaluated once in float64 and rounded to float32, so every CPU gets the same bytes. torch's float32 exp is within
# an ulp of it, and which entries differ depends on the CPU's instruction set (docs/numerics.md §6).
_EXPONENT = np.float32(-np.log(10000.0)) * np.arange(TIMESTEP_CHANNELS // 2, dtype=np.float32) / np.float32(128)
TIMESTEP_FREQS = np.exp(_EXPONENT.astype(np.float64)).astype(np.float32)


def timestep_embedding(sigma: jax.Array, dtype) -> jax.Array:
    """Sinusoidal embedding of sigma * 1000: [cos | sin] (flip_sin_to_cos), all fp32, output cast to `dtype`.

    diffusers casts sigma and the frequency table to the model dtype first, so a bf16 model sees sigma 0.37 as
    0.369140625; docs/numerics.md §6 feeds sigma as fp32 instead (the rollout engines do the same).
    """
    freqs = jnp.asarray(TIMESTEP_FREQS)
    arg = 1000.0 * (sigma.astype(jnp.float32)[:, None] * freqs[None, :])
    return jnp.concatenate([jnp.cos(arg), jnp.sin(arg)], axis=-1).astype(dtype)


def inv_freq(dim: int, theta: float = _ROPE_THETA) -> np.ndarray:
    """RoPE's inverse frequencies theta^(-2i/dim), i < dim/2: the float64 power rounded once to float32, within an
    ulp of torch.pow(theta, float32 exponent)."""
    exponent = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / np.power(np.float64(theta), exponent.astype(np.float64)).astype(np.float32))


def rope_angles(grid_h: int, grid_w: int, txt_len: int, axes_dims: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Rotation angles (fp32) for image tokens (h*w, head_dim/2) and text tokens (txt_len, head_dim/2).

    Image rows/cols are centred: positions -ceil(n/2) .. floor(n/2)-1; frame position 0. Text token j sits at
    max(h//2, w//2) + j on all three axes.
    """
    inv = [inv_freq(d) for d in axes_dims]
    rows = np.arange(grid_h) - (grid_h - grid_h // 2)
    cols = np.arange(grid_w) - (grid_w - grid_w // 2)
    rr, cc = np.meshgrid(rows, cols, indexing="ij")
    pos = [np.zeros(grid_h * grid_w, np.int64), rr.reshape(-1), cc.reshape(-1)]
    img = np.concatenate([np.outer(p.astype(np.float32), f).astype(np.float32) for p, f in zip(pos, inv)], axis=1)
    tpos = (max(grid_h // 2, grid_w // 2) + np.arange(txt_len)).astype(np.float32)
    txt = np.concatenate([np.outer(tpos, f).astype(np.float32) for f in inv], axis=1)
    return img, txt


def rope_tables(angles: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the fp32 angles, evaluated in float64 and rounded once: the same bytes on every CPU."""
    a = np.asarray(angles, np.float32).astype(np.float64)
    return jnp.asarray(np.cos(a).astype(np.float32)), jnp.asarray(np.sin(a).astype(np.float32))


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate interleaved pairs (x[2k], x[2k+1]) of x (B, S, H, D) by angles (S, D/2); fp32 math, input dtype out."""
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    re, im = xf[..., 0], xf[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = jnp.stack([re * c - im * s, re * s + im * c], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)
