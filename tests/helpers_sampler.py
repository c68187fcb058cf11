"""A jitted JAX sampling loop (DiT + SDE step) producing rollout trajectories for the train-step tests.

Per sample, everything comes from its seed: the initial latent and the step noise from
`jax.random.fold_in(key(seed), i)` (i = 0 for the initial latent, i + 1 for step i), and the SDE window from
`schedule.sample_windows`. Steps outside the window are ODE (noise level 0). The output holds the Trajectory fields
the train step consumes (docs/numerics.md §9), with the conditioning passed through.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxflow.algorithms import sde
from jaxflow.algorithms import flowgrpo
from jaxflow.nn.lora import LoRAParam
from jaxflow_bridge.contract import schedule
from jaxflow_bridge.families.qwen_image import spec as qwen_spec

TEXT_FIELDS = ("prompt_embeds", "prompt_mask", "negative_prompt_embeds", "negative_prompt_mask")


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """Resolution (latent grid), schedule, SDE type and noise, true-CFG guidance, SDE window."""

    grid_hw: tuple[int, int]
    num_steps: int = 10
    sde_type: str = "sde"
    noise_level: float = 1.2
    guidance: float = 1.0
    window_size: int | None = 2           # 0 / None: every step but the last
    window_range: tuple[int, int] = (0, 5)
    scheduler_config: dict = dataclasses.field(default_factory=lambda: dict(qwen_spec.SCHEDULER_CONFIG))

    def sigmas(self) -> np.ndarray:
        h, w = self.grid_hw
        return schedule.sigma_schedule(self.scheduler_config, self.num_steps, h * w)


def _sample_loop(lora, frozen, text, seeds, starts, levels, sigmas, *, graphdef, config: SamplerConfig,
                 width: int, channels: int):
    model = nnx.merge(graphdef, lora, frozen)
    b, (h, w) = seeds.shape[0], config.grid_hw
    keys = jax.vmap(jax.random.key)(seeds)

    def normal(i):
        return jax.vmap(lambda k: jax.random.normal(jax.random.fold_in(k, i), (h * w, channels)))(keys)

    def body(carry, i):
        x, latents, log_probs = carry
        slot = i - starts  # this step's position in each sample's window
        latents = jnp.where((jnp.arange(width + 1) == slot[:, None])[:, :, None, None], x[:, None], latents)
        sigma = jnp.full((b,), sigmas[i])
        v = flowgrpo.guided_velocity(model, x, sigma, *(text.get(k) for k in TEXT_FIELDS), grid_hw=config.grid_hw,
                                     guidance=config.guidance)
        x, log_prob, _, _ = sde.sde_step(x, v, sigma, sigmas[i + 1], sigmas[1], sde_type=config.sde_type,
                                         noise_level=levels[:, i], noise=normal(i + 1))
        log_probs = jnp.where(jnp.arange(width) == slot[:, None], log_prob[:, None], log_probs)
        return (x, latents, log_probs), None

    init = (normal(0), jnp.zeros((b, width + 1, h * w, channels), jnp.float32), jnp.zeros((b, width), jnp.float32))
    (x, latents, log_probs), _ = jax.lax.scan(body, init, jnp.arange(config.num_steps))
    return {"latents": latents, "log_probs": log_probs, "final_latents": x}


def make_sampler(model: nnx.Module, config: SamplerConfig):
    """Returns sample(inputs, seeds, lora=None) -> trajectory dict.

    inputs: prompt_embeds (B, L, D), prompt_mask (B, L) and, when guidance > 1, negative_prompt_embeds /
    negative_prompt_mask. seeds: (B,) ints. lora: a LoRAParam state (e.g. TrainState.lora; default: the
    model's own). Output: latents (B, W+1, S, C), log_probs (B, W), step_index (B, W) int32, sigmas (N+1,),
    noise_level (scalar), final_latents (B, S, C) and the text inputs.
    """
    graphdef, model_lora, frozen = nnx.split(model, LoRAParam, ...)
    sigmas = config.sigmas()
    width = config.window_size or config.num_steps - 1
    run = jax.jit(functools.partial(_sample_loop, graphdef=graphdef, config=config, width=width,
                                    channels=model.cfg.in_channels))

    def sample(inputs: dict, seeds, lora=None) -> dict:
        seeds = np.asarray(seeds)
        starts = schedule.sample_windows(seeds, config.window_size, config.window_range, config.num_steps)
        levels = schedule.window_noise_levels(starts, config.window_size, config.num_steps, config.noise_level)
        text = {k: jnp.asarray(inputs[k]) for k in TEXT_FIELDS if inputs.get(k) is not None}
        out = run(model_lora if lora is None else lora, frozen, text, jnp.asarray(seeds.astype(np.uint32)),
                  jnp.asarray(starts), jnp.asarray(levels), jnp.asarray(sigmas))
        step_index = (starts[:, None] + np.arange(width)).astype(np.int32)
        return {**out, **text, "step_index": step_index, "sigmas": sigmas,
                "noise_level": np.float32(config.noise_level)}

    return sample
