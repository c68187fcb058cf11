"""Flax Qwen-Image transformer vs diffusers (fp32, converted weights) (docs/numerics.md §6)."""
from unittest import mock

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope, QwenTimestepProjEmbeddings

from jaxflow.families.qwen_image.config import QwenImageConfig
from jaxflow.nn.config import ModelOptions
from jaxflow.nn.embeddings import TIMESTEP_FREQS, inv_freq, rope_angles, rope_tables, timestep_embedding
from jaxflow.families.qwen_image.loading import build_from_source
from jaxflow.nn.weights import TensorSource
from tests.qwen_ref import OTHER, TINY, inputs, state_dict_numpy, torch_forward, torch_model

TOL = 1e-5


def rel_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float32) - b)) / np.max(np.abs(b)))


def flax_model(cfg, seed=0, opts=ModelOptions()):
    tm = torch_model(cfg, seed)
    model = build_from_source(QwenImageConfig(**cfg), TensorSource(state_dict_numpy(tm)), opts)
    return tm, model


@pytest.mark.parametrize("cfg", [TINY, OTHER], ids=["tiny", "other"])
@pytest.mark.parametrize("sigmas", [(1.0, 0.37), (0.02, 0.999), (0.5, 0.5)])
def test_forward_matches_diffusers_with_padding_mask(cfg, sigmas):
    tm, model = flax_model(cfg)
    x, s, txt, mask = inputs(cfg, sigmas=sigmas)
    ref = torch_forward(tm, x, s, txt, mask, (5, 9))
    out = model(jnp.asarray(x), jnp.asarray(s), jnp.asarray(txt), jnp.asarray(mask), (5, 9))
    assert rel_err(out, ref) <= TOL


def test_padding_with_mask_equals_unpadded():
    tm, model = flax_model(TINY)
    x, s, txt, mask = inputs(TINY, batch=1, txt_lens=(4,), sigmas=(0.6,))
    padded = np.concatenate([txt, np.zeros((1, 5, txt.shape[-1]), np.float32)], axis=1)
    pmask = np.concatenate([mask, np.zeros((1, 5), bool)], axis=1)
    a = model(jnp.asarray(x), jnp.asarray(s), jnp.asarray(txt), None, (5, 9))
    b = model(jnp.asarray(x), jnp.asarray(s), jnp.asarray(padded), jnp.asarray(pmask), (5, 9))
    # RoPE uses the padded width for the text offset only through positions of valid tokens, which are equal.
    assert rel_err(b, np.asarray(a)) <= TOL


@pytest.mark.parametrize("grid", [(4, 4), (9, 5), (3, 7)])
def test_forward_no_mask_odd_grids(grid):
    tm, model = flax_model(TINY, seed=3)
    x, s, txt, _ = inputs(TINY, batch=2, grid=grid, txt_lens=(6, 6), sigmas=(0.8, 0.1), seed=5)
    ref = torch_forward(tm, x, s, txt, None, grid)
    out = model(jnp.asarray(x), jnp.asarray(s), jnp.asarray(txt), None, grid)
    assert rel_err(out, ref) <= TOL


def test_rope_tables_match_diffusers():
    """Angles and cos/sin tables against diffusers' own, with bounds from the computation (docs/numerics.md,
    "Tables"). Each side forms inv_freq with its own pow (<= 1 ulp; torch's depends on the CPU's instruction set)
    and a reciprocal, then rounds pos * inv_freq: < 4 * 2**-23 relative together, so |d angle| <= 2**-21 |angle|.
    cos/sin move by at most |d angle|, plus each side's rounding of a result in [-1, 1] (2**-24 each)."""
    axes = (16, 56, 56)
    captured, polar = [], torch.polar

    def spy(abs_, angle):  # diffusers builds its angle table (positions 0..4095) once, in __init__
        captured.append(angle.clone())
        return polar(abs_, angle)

    with mock.patch.object(torch, "polar", spy):
        rope = QwenEmbedRope(theta=10000, axes_dim=list(axes), scale_rope=True)
    theirs = torch.cat(captured[:3], dim=1).numpy()
    ours = np.outer(np.arange(len(theirs), dtype=np.float32), np.concatenate([inv_freq(d) for d in axes]))
    assert ours.shape == theirs.shape
    assert np.all(np.abs(ours.astype(np.float32) - theirs) <= 2.0**-21 * np.abs(theirs))
    for h, w, L in ((64, 64, 20), (5, 9, 7), (32, 17, 3)):
        img_ref, txt_ref = rope([(1, h, w)], max_txt_seq_len=L, device=torch.device("cpu"))
        for ang, ref in zip(rope_angles(h, w, L, axes), (img_ref, txt_ref)):
            bound = 2.0**-21 * np.abs(ang) + 2.0**-23
            for table, expected in zip(rope_tables(ang), (ref.real.numpy(), ref.imag.numpy())):
                assert table.shape == expected.shape
                assert np.all(np.abs(np.asarray(table) - expected) <= bound)


def test_timestep_embedding_matches_diffusers():
    """The argument a = 1000 * (sigma * f) is fp32. torch's fp32 exp puts f within 1 ulp of our table (1.5 * 2**-23
    relative with our own rounding); each side rounds sigma * f and 1000 * (.) (2**-24 each): < 4 * 2**-23
    relative, so |d a| <= 2**-21 |a| (5e-4 rad at a = 1000). cos/sin add each side's result rounding (2**-24)."""
    emb = QwenTimestepProjEmbeddings(embedding_dim=32)
    sig = np.array([1.0, 0.98971, 0.5, 0.02, 0.0], np.float32)
    ref = emb.time_proj(torch.from_numpy(sig)).numpy()
    out = np.asarray(timestep_embedding(jnp.asarray(sig), jnp.float32))
    arg = np.float32(1000.0) * (sig[:, None] * TIMESTEP_FREQS[None, :])
    assert out.shape == ref.shape == (5, 256)
    assert np.all(np.abs(out - ref) <= 2.0**-21 * np.abs(np.concatenate([arg, arg], axis=1)) + 2.0**-23)


def test_bf16_within_rounding_of_fp32_reference():
    tm, _ = flax_model(TINY)
    model = build_from_source(QwenImageConfig(**TINY), TensorSource(state_dict_numpy(tm)),
                              ModelOptions(dtype="bfloat16", param_dtype="bfloat16"))
    x, s, txt, mask = inputs(TINY)
    ref = torch_forward(tm, x, s, txt, mask, (5, 9))
    out = model(jnp.asarray(x), jnp.asarray(s), jnp.asarray(txt), jnp.asarray(mask), (5, 9))
    err = rel_err(out, ref)
    print(f"bf16 vs fp32 reference: max|d|/max|ref| = {err:.3e}")
    assert err <= 2e-2
