"""Qwen-Image-Edit's window log-prob: Qwen-Image's (`flowgrpo.window_log_prob`, true CFG on the text embeds) with the
trajectory's reference latents (`reference_latents`, the same at every window step and for both CFG passes)."""
from __future__ import annotations

import jax.numpy as jnp

from jaxflow.algorithms import flowgrpo
from jaxflow.algorithms.objective import Objective


def with_references(model, refs):
    """`model` as the text-to-image call `flowgrpo.guided_velocity` makes, each row with its references (CFG's
    batched call pairs each sample's positive and negative rows, `flowgrpo.paired`: each reference is repeated in
    place to match)."""

    def call(x, sigma, txt, txt_mask, *, grid_hw, lora_scale=1.0):
        r = refs if x.shape[0] == refs.shape[0] else jnp.repeat(refs, x.shape[0] // refs.shape[0], axis=0)
        return model(x, sigma, txt, txt_mask, grid_hw, lora_scale, refs=r)

    return call


def _window_log_prob(model, tr: dict, config, lora_scale: float = 1.0):
    """`config`: the step's TrainConfig (grid_hw, sde_type, guidance); tr holds `reference_latents` (B, R, S, C)."""
    if "reference_latents" not in tr:
        raise ValueError("the edit model's batch has no reference_latents: the rollout sends them "
                         "(the edit pipeline's trajectory)")
    return flowgrpo.window_log_prob(with_references(model, tr["reference_latents"]), tr, grid_hw=config.grid_hw,
                                    sde_type=config.sde_type, guidance=config.guidance, lora_scale=lora_scale)


EDIT_WINDOW = Objective(lambda model, shared, config: shared, _window_log_prob,
                        lambda model, step: with_references(model, step["reference_latents"]))
