"""Timestep embedding and Qwen-Image RoPE (interleaved pairs, centred image grid, text offset)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

TIMESTEP_CHANNELS = 256
_ROPE_THETA = 10000.0


# exp(-ln(10000) i / 128), i < 128, as float32 bit patterns of torch's float32 exp (diffusers'
# get_timestep_embedding). numpy's float32 exp differs from it by 1 ulp in 54 entries, which moves the
# argument 1000*sigma*f by up to 5e-5 rad; hence the table is fixed here (checked against torch in the tests).
_TIMESTEP_FREQ_BITS = np.array([
    0x3f800000, 0x3f6e39f8, 0x3f5dafd6, 0x3f4e4bac, 0x3f3ff911, 0x3f32a506, 0x3f263de0, 0x3f1ab32b, 0x3f0ff59a,
    0x3f05f6ee, 0x3ef953ce, 0x3ee80460, 0x3ed7e89a, 0x3ec8eb24, 0x3ebaf81b, 0x3eadfcff, 0x3ea1e89b, 0x3e96aaea,
    0x3e8c3503, 0x3e827908, 0x3e72d422, 0x3e61f836, 0x3e5247ed, 0x3e43ae7c, 0x3e361887, 0x3e297409, 0x3e1db03f,
    0x3e12bd90, 0x3e088d77, 0x3dfe24df, 0x3dec7fd5, 0x3ddc1464, 0x3dcccccc, 0x3dbe94c7, 0x3db15978, 0x3da50957,
    0x3d99940d, 0x3d8eea6c, 0x3d84fe4c, 0x3d778511, 0x3d6655c1, 0x3d5657e3, 0x3d477640, 0x3d399d18, 0x3d2cba16,
    0x3d20bc1b, 0x3d159348, 0x3d0b30cb, 0x3d0186e2, 0x3cf11177, 0x3ce054d1, 0x3cd0c1a8, 0x3cc2434e, 0x3cb4c691,
    0x3ca83989, 0x3c9c8b96, 0x3c91ad39, 0x3c879009, 0x3c7c4d30, 0x3c6ac8e6, 0x3c5a7bf1, 0x3c4b50b5, 0x3c3d330e,
    0x3c301050, 0x3c23d70a, 0x3c187706, 0x3c0de12e, 0x3c040777, 0x3bf5b9ad, 0x3be4aa45, 0x3bd4ca15, 0x3bc6040a,
    0x3bb8449a, 0x3bab7982, 0x3b9f91cc, 0x3b947daf, 0x3b8a2e75, 0x3b80967c, 0x3b6f520d, 0x3b5eb47a, 0x3b4f3e33,
    0x3b40dac2, 0x3b33770d, 0x3b270153, 0x3b1b690d, 0x3b109ed8, 0x3b06946d, 0x3afa78f0, 0x3ae91528, 0x3ad8e675,
    0x3ac9d759, 0x3abbd3eb, 0x3aaec98e, 0x3aa2a6f7, 0x3a975c0b, 0x3a8cd9d9, 0x3a83126e, 0x3a73f1a2, 0x3a6301e3,
    0x3a533f24, 0x3a44948a, 0x3a36ee9d, 0x3a2a3b44, 0x3a1e69a2, 0x3a136a14, 0x3a092e01, 0x39ff4fac, 0x39ed95e4,
    0x39dd1721, 0x39cdbd93, 0x39bf74d6, 0x39b229fb, 0x39a5cb61, 0x399a48a0, 0x398f9275, 0x39859aa4, 0x3978a80d,
    0x3967648c, 0x395753e2, 0x394860c0, 0x393a7753, 0x392d852a, 0x39217919, 0x39164326, 0x390bd46d, 0x39021f28,
    0x38f22cdd, 0x38e15c8e
], dtype=np.uint32)


def timestep_embedding(sigma: jax.Array, dtype) -> jax.Array:
    """Sinusoidal embedding of sigma * 1000: [cos | sin] (flip_sin_to_cos), all fp32, output cast to `dtype`.

    diffusers casts sigma and the frequency table to the model dtype first, so a bf16 model sees sigma 0.37 as
    0.369140625; DESIGN.md §4 feeds sigma as fp32 instead (the rollout engines do the same).
    """
    freqs = jnp.asarray(_TIMESTEP_FREQ_BITS.view(np.float32))
    arg = 1000.0 * (sigma.astype(jnp.float32)[:, None] * freqs[None, :])
    return jnp.concatenate([jnp.cos(arg), jnp.sin(arg)], axis=-1).astype(dtype)


def _inv_freq(dim: int) -> np.ndarray:
    # float64 power rounded once to float32 reproduces torch.pow(10000, float32 exponent) exactly.
    exponent = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / np.power(np.float64(_ROPE_THETA), exponent.astype(np.float64)).astype(np.float32))


def rope_angles(grid_h: int, grid_w: int, txt_len: int, axes_dims: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Rotation angles (fp32) for image tokens (h*w, head_dim/2) and text tokens (txt_len, head_dim/2).

    Image rows/cols are centred: positions -ceil(n/2) .. floor(n/2)-1; frame position 0. Text token j sits at
    max(h//2, w//2) + j on all three axes.
    """
    inv = [_inv_freq(d) for d in axes_dims]
    rows = np.arange(grid_h) - (grid_h - grid_h // 2)
    cols = np.arange(grid_w) - (grid_w - grid_w // 2)
    rr, cc = np.meshgrid(rows, cols, indexing="ij")
    pos = [np.zeros(grid_h * grid_w, np.int64), rr.reshape(-1), cc.reshape(-1)]
    img = np.concatenate([np.outer(p.astype(np.float32), f).astype(np.float32) for p, f in zip(pos, inv)], axis=1)
    tpos = (max(grid_h // 2, grid_w // 2) + np.arange(txt_len)).astype(np.float32)
    txt = np.concatenate([np.outer(tpos, f).astype(np.float32) for f in inv], axis=1)
    return img, txt


def rope_tables(angles: np.ndarray) -> tuple[jax.Array, jax.Array]:
    a = jnp.asarray(angles, jnp.float32)
    return jnp.cos(a), jnp.sin(a)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate interleaved pairs (x[2k], x[2k+1]) of x (B, S, H, D) by angles (S, D/2); fp32 math, input dtype out."""
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    re, im = xf[..., 0], xf[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = jnp.stack([re * c - im * s, re * s + im * c], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)
