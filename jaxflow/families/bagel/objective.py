"""FlowGRPO's log-prob of stored transitions for BAGEL (docs/bagel.md §2, §4): the two contexts prefilled once from the
trajectory's token ids, BAGEL's text CFG (interval, per-sample "global" renorm) and the SDE log-prob of
`jaxflow.algorithms.sde`. The Qwen-Image counterpart is `jaxflow.algorithms.flowgrpo`; the torch rollout this mirrors is
`jaxflow_bridge/families/bagel/sampling.py`."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from jaxflow.algorithms import sde
from jaxflow.algorithms import flowgrpo
from jaxflow.algorithms.objective import Objective
from jaxflow.families.bagel.model import BagelModel, KVCache

if TYPE_CHECKING:  # step_config resolves the algorithms, which reach this module
    from jaxflow.trainer.step_config import TrainConfig

RENORM_EPS = 1e-8  # Bagel._combine_cfg's denominator guard


@dataclasses.dataclass(frozen=True)
class BagelGuidance:
    """BAGEL's text CFG as sampled (BagelSamplingParams' cfg_text_scale / cfg_interval / cfg_renorm_min): on iff
    text_scale > 1, at steps with lo < sigma <= hi; renorm factor clamped to [renorm_min, 1]."""

    text_scale: float = 4.0
    interval: tuple[float, float] = (0.0, 1.0)
    renorm_min: float = 0.0

    def __post_init__(self):
        lo, hi = self.interval
        if self.text_scale < 1 or not 0 <= lo <= hi <= 1 or not 0 <= self.renorm_min <= 1:
            raise ValueError(f"BagelGuidance needs text_scale >= 1, 0 <= lo <= hi <= 1 and renorm_min in [0, 1], "
                             f"got {self.text_scale}, {self.interval}, {self.renorm_min}")

    @property
    def on(self) -> bool:
        return self.text_scale > 1


class Context(NamedTuple):
    """A prefilled context: every layer's K/V (layers, B, L, kv_heads, head_dim) and its (B, L) mask."""

    kv: KVCache
    mask: jax.Array


def prefill(model: BagelModel, ids: jax.Array, mask: jax.Array) -> Context:
    """The frozen K/V (stop_gradient) of right-padded context ids (B, L); L = 0 is the empty context."""
    cfg = model.cfg
    if ids.shape[1] == 0:
        shape = (cfg.num_hidden_layers, ids.shape[0], 0, cfg.num_key_value_heads, cfg.head_dim)
        empty = jnp.zeros(shape, model.opts.compute_dtype)
        return Context((empty, empty), mask)
    return Context(jax.lax.stop_gradient(model.prefill(ids)), mask)


def contexts(model: BagelModel, batch: dict, guidance: BagelGuidance) -> tuple[Context, Context | None]:
    """The conditional context from prompt_ids / prompt_mask and, with CFG on, the unconditional one from
    negative_prompt_ids / negative_prompt_mask (each prefilled once, reused at every window step)."""
    cond = prefill(model, batch["prompt_ids"], batch["prompt_mask"])
    if not guidance.on:
        return cond, None
    if "negative_prompt_ids" not in batch:
        raise ValueError(f"text CFG scale {guidance.text_scale} > 1 needs negative_prompt_ids / _mask "
                         "(the empty unconditional context is (B, 0))")
    return cond, prefill(model, batch["negative_prompt_ids"], batch["negative_prompt_mask"])


def guided_velocity(model: BagelModel, x: jax.Array, sigma: jax.Array, cond: Context, uncond: Context | None, *,
                    grid_hw: tuple[int, int], guidance: BagelGuidance, lora_scale: float = 1.0) -> jax.Array:
    """Velocity (B, S, C) float32 at sigma (B,): conditional, or, for the samples with lo < sigma <= hi and CFG on,
    v = v_u + s (v_c - v_u) times clamp(|v_c| / (|v| + 1e-8), renorm_min, 1), norms over each sample's elements."""
    v_c = model.denoise(cond.kv, cond.mask, x, sigma, grid_hw, lora_scale).astype(jnp.float32)
    if not guidance.on:
        return v_c
    v_u = model.denoise(uncond.kv, uncond.mask, x, sigma, grid_hw, lora_scale).astype(jnp.float32)
    return combine_cfg(v_c, v_u, sigma, guidance)


def combine_cfg(v_c: jax.Array, v_u: jax.Array, sigma: jax.Array, guidance: BagelGuidance) -> jax.Array:
    """`guided_velocity`'s CFG of the branch velocities (B, ...) float32 at sigma (B,) (bagel_sampling's
    `guided_velocity` where lo < sigma <= hi, v_c elsewhere)."""
    v = v_u + guidance.text_scale * (v_c - v_u)
    norm = lambda t: jnp.linalg.norm(t.reshape(t.shape[0], -1), axis=1)  # noqa: E731
    factor = jnp.clip(norm(v_c) / (norm(v) + RENORM_EPS), guidance.renorm_min, 1.0)
    lo, hi = guidance.interval
    inside = (sigma > lo) & (sigma <= hi)
    per_sample = lambda a: a.reshape(-1, *(1,) * (v.ndim - 1))  # noqa: E731
    return jnp.where(per_sample(inside), v * per_sample(factor), v_c)


def window_log_prob(model: BagelModel, tr: dict, cond: Context, uncond: Context | None, *,
                    grid_hw: tuple[int, int], sde_type: str, guidance: BagelGuidance, lora_scale: float = 1.0):
    """(mean, log_prob (B,), std) of one window step's stored next latent under the model's SDE step (lora_scale 0:
    the adapters off, the KL reference).

    `tr` holds x, x_next (B, S, C); sigma, sigma_next, sigma_max, noise_level (B,)."""
    v = guided_velocity(model, tr["x"], tr["sigma"], cond, uncond, grid_hw=grid_hw, guidance=guidance,
                        lora_scale=lora_scale)
    _, logp, mean, std = sde.sde_step(tr["x"], v, tr["sigma"], tr["sigma_next"], tr["sigma_max"],
                                      sde_type=sde_type, noise_level=tr["noise_level"], prev_sample=tr["x_next"])
    return mean, logp, std


def window_steps(batch: dict) -> tuple[dict, dict]:
    """`flowgrpo.window_steps` of a trajectory's arrays whose sigmas may be (N+1,) or per sample (B, N+1) and
    noise_level a scalar or (B,). latents (B, W+1, S, C), step_index (B, W)."""
    b = batch["latents"].shape[0]
    sigmas = jnp.broadcast_to(jnp.asarray(batch["sigmas"], jnp.float32), (b, batch["sigmas"].shape[-1]))
    noise = jnp.broadcast_to(jnp.asarray(batch["noise_level"], jnp.float32), (b,))
    return flowgrpo.window_steps({**batch, "sigmas": sigmas, "noise_level": noise})


def window_log_probs(model: BagelModel, batch: dict, *, grid_hw: tuple[int, int], sde_type: str,
                     guidance: BagelGuidance) -> jax.Array:
    """Log-probs (B, W) of a batch's stored window transitions under the model (its LoRA applied), the contexts
    prefilled once for all W steps. `batch`: prompt_ids / prompt_mask, with CFG negative_prompt_ids / _mask, and
    `window_steps`' fields (a TrajectoryBatch's arrays plus noise_level)."""
    cond, uncond = contexts(model, batch, guidance)
    per_step, shared = window_steps(batch)

    def step(_, xs):
        tr = {**shared, **xs}
        return None, window_log_prob(model, tr, cond, uncond, grid_hw=grid_hw, sde_type=sde_type,
                                     guidance=guidance)[1]

    return jax.lax.scan(step, None, per_step)[1].T


def guidance_of(config: TrainConfig) -> BagelGuidance:
    """BAGEL's text CFG from the train step's config: scale `guidance`, `cfg_interval`, `cfg_renorm_min`."""
    return BagelGuidance(config.guidance, config.cfg_interval, config.cfg_renorm_min)


def _context(model, shared: dict, config: TrainConfig) -> dict:
    return {**shared, "contexts": contexts(model, shared, guidance_of(config))}


def _log_prob(model, tr: dict, config: TrainConfig, lora_scale: float = 1.0):
    return window_log_prob(model, tr, *tr["contexts"], grid_hw=config.grid_hw, sde_type=config.sde_type,
                           guidance=guidance_of(config), lora_scale=lora_scale)


OBJECTIVE = Objective(_context, _log_prob)  # the train step's (`jaxflow.algorithms.objective`)
