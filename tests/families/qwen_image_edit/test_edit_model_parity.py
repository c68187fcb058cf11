"""The Flax edit transformer (Qwen-Image's over target + reference tokens) vs diffusers' QwenImageTransformer2DModel
fed the same packed tokens and img_shapes, as QwenImageEdit(Plus)Pipeline calls it: float32, with a LoRA."""
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxflow.families.qwen_image.config import QwenImageConfig
from jaxflow.families.qwen_image.lora import QwenImageLoRASpec
from jaxflow.families.qwen_image.loading import build_from_source
from jaxflow.families.qwen_image_edit.transformer import QwenImageEditTransformer
from jaxflow.nn.lora import peft_to_lora
from jaxflow.nn.weights import TensorSource
from tests.qwen_ref import TINY, inputs, state_dict_numpy, torch_model, torch_with_adapter

TOL = 1e-5  # float32: the same sums in another order, a few eps times the depth
SPEC = QwenImageLoRASpec(rank=4, alpha=8.0)


def rel_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float32) - b)) / np.max(np.abs(b)))


def models(lora: bool):
    """The diffusers model (with a random PEFT adapter if `lora`) and the Flax edit model of the same weights."""
    if not lora:
        tm = torch_model(TINY)
        return tm, build_from_source(QwenImageConfig(**TINY), TensorSource(state_dict_numpy(tm)),
                                     model_type=QwenImageEditTransformer)
    tm, base, peft = torch_with_adapter(TINY, SPEC)
    model = build_from_source(QwenImageConfig(**TINY), TensorSource(base), lora=SPEC,
                              model_type=QwenImageEditTransformer)
    peft_to_lora(model, SPEC, peft)
    return tm, model


def reference_tokens(grids, batch=2, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((batch, h * w, TINY["in_channels"])).astype(np.float32) for h, w in grids]


def diffusers_velocity(tm, x, refs, sigma, txt, mask, grid, ref_grids):
    """As the edit pipelines call it: target then reference tokens, img_shapes listing each, target rows kept."""
    tokens = np.concatenate([x, *refs], axis=1)
    shapes = [[(1, *grid), *((1, *g) for g in ref_grids)]] * x.shape[0]
    with torch.no_grad():
        out = tm(hidden_states=torch.from_numpy(tokens), timestep=torch.from_numpy(sigma),
                 encoder_hidden_states=torch.from_numpy(txt), encoder_hidden_states_mask=torch.from_numpy(mask),
                 img_shapes=shapes, return_dict=False)[0]
    return out[:, : x.shape[1]].numpy()


@pytest.mark.parametrize("references", [1, 2], ids=["edit", "plus-2"])
def test_edit_forward_matches_diffusers_with_lora(references):
    tm, model = models(lora=True)
    x, s, txt, mask = inputs(TINY, sigmas=(0.9, 0.3))
    grids = ((5, 9),) * references
    refs = reference_tokens(grids)
    ref = diffusers_velocity(tm, x, refs, s, txt, mask, (5, 9), grids)
    args = (jnp.asarray(x), jnp.asarray(s), jnp.asarray(txt), jnp.asarray(mask), (5, 9))
    assert rel_err(model(*args, refs=jnp.asarray(np.stack(refs, axis=1))), ref) <= TOL
    tm.disable_adapters()  # adapters off (the KL reference) is the base edit model
    base = diffusers_velocity(tm, x, refs, s, txt, mask, (5, 9), grids)
    assert rel_err(model(*args, lora_scale=0.0, refs=jnp.asarray(np.stack(refs, axis=1))), base) <= TOL
    # the reference tokens change the velocity (they are attended to, not ignored)
    assert rel_err(diffusers_velocity(tm, x, [r + 1.0 for r in refs], s, txt, mask, (5, 9), grids), base) > 1e-3


def test_edit_forward_other_reference_sizes_one_per_call():
    """References of different grids ride as one image each ((B, 1, S_r, C)); the RoPE sees each at its frame."""
    tm, model = models(lora=True)
    x, s, txt, mask = inputs(TINY, sigmas=(0.6, 0.2))
    for grid in ((4, 6), (9, 5)):
        refs = reference_tokens((grid,))
        ref = diffusers_velocity(tm, x, refs, s, txt, mask, (5, 9), (grid,))
        out = model(jnp.asarray(x), jnp.asarray(s), jnp.asarray(txt), jnp.asarray(mask), (5, 9),
                    refs=jnp.asarray(refs[0][:, None]), ref_grids=(grid,))
        assert rel_err(out, ref) <= TOL


def test_edit_model_refuses_missing_or_mismatched_references():
    _, model = models(lora=False)
    x, s, txt, mask = inputs(TINY)
    args = (jnp.asarray(x), jnp.asarray(s), jnp.asarray(txt), jnp.asarray(mask), (5, 9))
    with pytest.raises(ValueError, match="reference images' latents"):
        model(*args)
    with pytest.raises(ValueError, match="do not hold"):
        model(*args, refs=jnp.zeros((2, 1, 44, 64)))
