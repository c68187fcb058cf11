"""BAGEL's position and timestep encodings: 1-D NeoX RoPE, the latents' 2-D sin-cos table, the DiT timestep sinusoid."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow.nn.embeddings import TIMESTEP_FREQS, inv_freq


def rope_tables(num_positions: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin (num_positions, head_dim/2) of positions 0.. times theta^(-2i/head_dim): each angle rounded to
    float32 (as torch forms position * inv_freq), its cos/sin evaluated in float64 and rounded once (every CPU gives
    the same bytes)."""
    angles = np.outer(np.arange(num_positions, dtype=np.float32), inv_freq(head_dim, theta)).astype(np.float32)
    a = angles.astype(np.float64)
    return jnp.asarray(np.cos(a).astype(np.float32)), jnp.asarray(np.sin(a).astype(np.float32))


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """NeoX (rotate-half) RoPE of x (B, S, H, D): the pairs are (x[i], x[i + D/2]), rotated by angle i. cos/sin
    (B or 1, S or 1, D/2) broadcast over heads; fp32 math, the input dtype out."""
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def timestep_embedding(t: jax.Array, dtype) -> jax.Array:
    """GLIDE/DiT sinusoid of the raw sigma t (B,) in [0, 1] (no x1000, unlike Qwen-Image): [cos | sin] of t * f_i,
    f_i = exp(-ln(1e4) i / 128), i < 128; fp32, cast to `dtype`."""
    arg = t.astype(jnp.float32)[:, None] * jnp.asarray(TIMESTEP_FREQS)[None, :]
    return jnp.concatenate([jnp.cos(arg), jnp.sin(arg)], axis=-1).astype(dtype)


def latent_pos_table(max_latent_size: int, hidden: int) -> np.ndarray:
    """The frozen 2-D sin-cos table (max_latent_size^2, hidden) that BAGEL stores as `latent_pos_embed.pos_embed`.

    Row r * max_latent_size + c is [sin(c w), cos(c w), sin(r w), cos(r w)], w_k = 1e4^(-k / (hidden/4)),
    k < hidden/4, in float64 then float32. The column comes first: vLLM-Omni's grid is meshgrid(w, h), whose first
    plane (the column index) fills the first half despite its comment "half of dimensions to encode grid_h".
    """
    quarter = hidden // 4
    omega = 1.0 / 10000.0 ** (np.arange(quarter, dtype=np.float64) / quarter)
    rows, cols = np.meshgrid(np.arange(max_latent_size), np.arange(max_latent_size), indexing="ij")
    parts = []
    for coord in (cols.reshape(-1), rows.reshape(-1)):
        arg = np.outer(coord.astype(np.float64), omega)
        parts += [np.sin(arg), np.cos(arg)]
    return np.concatenate(parts, axis=1).astype(np.float32)


def latent_position_ids(grid_h: int, grid_w: int, max_latent_size: int) -> np.ndarray:
    """Rows of `latent_pos_table` for an h x w latent grid in row-major token order: r * max_latent_size + c."""
    if max(grid_h, grid_w) > max_latent_size:
        raise ValueError(f"latent grid {grid_h} x {grid_w} exceeds max_latent_size {max_latent_size}")
    return (np.arange(grid_h)[:, None] * max_latent_size + np.arange(grid_w)[None, :]).reshape(-1)

