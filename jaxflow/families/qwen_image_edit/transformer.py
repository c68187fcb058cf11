"""Qwen-Image-Edit's transformer: Qwen-Image's (`jaxflow/families/qwen_image/transformer.py`, the same weights) fed the
reference images' packed latents as extra image tokens after the target's, each image at its own frame position in
the RoPE (`image_rope_angles`); the velocity is the target tokens' (diffusers' QwenImageEdit(Plus)Pipeline)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxflow.families.qwen_image.transformer import QwenImageTransformer


class QwenImageEditTransformer(QwenImageTransformer):
    """v = model(x, sigma, txt, txt_mask, grid_hw, lora_scale, refs, ref_grids): x (B, h*w, C) the target's packed
    latents, refs (B, R, S_r, C) the R reference images' (each of `ref_grids`' (h_r, w_r), default grid_hw;
    S_r = h_r * w_r) -> velocity (B, h*w, C) of the target."""

    def __call__(self, x, sigma, txt, txt_mask, grid_hw: tuple[int, int], lora_scale: float | jax.Array = 1.0,
                 refs=None, ref_grids: tuple[tuple[int, int], ...] | None = None):
        if refs is None:
            raise ValueError("the edit model needs the reference images' latents (refs, (B, R, S, C))")
        if refs.ndim != 4 or refs.shape[0] != x.shape[0]:
            raise ValueError(f"refs: expected (B={x.shape[0]}, R, S, C), got shape {refs.shape}")
        grids = tuple(ref_grids) if ref_grids is not None else (tuple(grid_hw),) * refs.shape[1]
        if len(grids) != refs.shape[1] or any(h * w != refs.shape[2] for h, w in grids):
            raise ValueError(f"refs of shape {refs.shape} do not hold {len(grids)} images of grids {grids}")
        tokens = jnp.concatenate([x, refs.reshape(refs.shape[0], -1, refs.shape[-1]).astype(x.dtype)], axis=1)
        with jax.default_matmul_precision(self.opts.precision):
            return self._forward(tokens, sigma, txt, txt_mask, (tuple(grid_hw), *grids), lora_scale)
