"""Flax Qwen-Image transformer vs diffusers (fp32, converted weights): DESIGN.md §4 / issue model-parity."""
import numpy as np
import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope, QwenTimestepProjEmbeddings
import jax.numpy as jnp

from jaxflow.models.config import ModelOptions, QwenImageConfig
from jaxflow.models.embeddings import rope_angles, rope_tables, timestep_embedding
from jaxflow.models.loading import TensorSource, build_from_source
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


def test_rope_tables_exact():
    axes = (16, 56, 56)
    rope = QwenEmbedRope(theta=10000, axes_dim=list(axes), scale_rope=True)
    for h, w, L in ((64, 64, 20), (5, 9, 7), (32, 17, 3)):
        img_ref, txt_ref = rope([(1, h, w)], max_txt_seq_len=L, device=torch.device("cpu"))
        img_ang, txt_ang = rope_angles(h, w, L, axes)
        for ang, ref in ((img_ang, img_ref), (txt_ang, txt_ref)):
            cos, sin = rope_tables(ang)
            np.testing.assert_array_equal(np.asarray(cos), ref.real.numpy())
            np.testing.assert_array_equal(np.asarray(sin), ref.imag.numpy())


def test_timestep_embedding():
    emb = QwenTimestepProjEmbeddings(embedding_dim=32)
    sig = np.array([1.0, 0.98971, 0.5, 0.02, 0.0], np.float32)
    ref = emb.time_proj(torch.from_numpy(sig)).numpy()
    out = np.asarray(timestep_embedding(jnp.asarray(sig), jnp.float32))
    assert np.max(np.abs(out - ref)) <= 1e-6


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
