"""GRPO-Guard's ratio (train.ratio_norm="guard"; Wang et al., arXiv 2510.22319, "RatioNorm" + 1/dt gradient
reweighting), used by FlowGRPO's clipped objective (`flowgrpo.window_step_terms`). docs/numerics.md §GRPO-Guard.

The paper normalizes the log-ratio of one denoising step t by that step's diffusion scale s_t = sigma_t sqrt(dt_t)
and divides the step's policy term by dt_t. Its official code (flow_grpo `scripts/train_sd3_GRPO_Guard.py`) and
verl-omni (`GRPOGuardLoss`) train one step per micro-batch and take s and dt as means over the micro-batch, which is
that step's value there. With the project's per-sample windows a micro-batch mixes steps: train.guard_stats picks
"sample" (each sample's own step's s and dt: the paper's per-step definition) or "batch" (the micro-batch means, as
verl-omni computes them on any batch)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxflow.algorithms.base import Component

STATS = ("sample", "batch")  # train.guard_stats' choices


def normalized_log_ratio(log_ratio, mean, old_mean, std, dt, sde_type: str, stats: str):
    """(s (log_ratio + mean((mu - mu_old)^2) / (2 s^2)), divisor): the normalized log-ratio (B,) and what the policy
    term is divided by. s = std sqrt(dt) ('sde': std is sigma_t; 'cps': std is already the step's), divisor = dt;
    with stats="batch" both are the micro-batch's (mean(std) mean(sqrt dt), mean(sqrt dt)^2), as in verl-omni.
    The drift is per sample, as in verl-omni and the paper (flow_grpo's trainer averages it over the micro-batch
    too: docs/numerics.md)."""
    sqrt_dt = jnp.sqrt(dt)
    if stats == "batch":
        sqrt_dt, std = jnp.mean(sqrt_dt), jnp.mean(std)
    step_std = std * sqrt_dt if sde_type == "sde" else std
    drift = jnp.mean(jnp.square(mean - old_mean).reshape(mean.shape[0], -1), axis=1)
    return step_std * (log_ratio + drift / (2 * step_std ** 2)), sqrt_dt ** 2


@dataclasses.dataclass(frozen=True)
class Guard(Component):
    """exp(s (logp - logp_old + mean((mu - mu_old)^2) / (2 s^2))) = exp(mean((mu - mu_old) eps)) for the sampled
    noise eps where s is the sample's own (`normalized_log_ratio`), clipped at train.guard_clip_range; the policy
    term divided by dt. mu_old: tr["old_mean"] (the recompute pass), or mu under stop_gradient where the update is
    on-policy (ratio exactly 1)."""

    old_means: bool = True

    def clip_range(self, config) -> float:
        return config.guard_clip_range

    def normalized(self, tr, mean, logp, std, old, log_ratio, sde_type, stats="sample"):
        old_mean = tr["old_mean"] if "old_mean" in tr else jax.lax.stop_gradient(mean)
        if "old_on_policy" in tr:
            old_mean = jnp.where(tr["old_on_policy"], jax.lax.stop_gradient(mean), old_mean)
        new, divisor = normalized_log_ratio(log_ratio, mean, old_mean, std, tr["sigma"] - tr["sigma_next"],
                                            sde_type, stats)
        return new, 0.0, divisor

    def rules(self, config, policy):
        return (("ratio_norm", not policy.old_log_prob.recompute,
                 f"'guard' needs old_log_prob='recompute' (got {config.old_log_prob!r}): the old policy's SDE means "
                 f"come from the trainer's pass"),
                ("guard_stats", config.guard_stats not in STATS,
                 "choose 'sample' (each sample's own step's scale and dt, the paper's) or 'batch' (the "
                 "micro-batch's means, verl-omni's)"),
                ("guard_clip_range", not config.guard_clip_range > 0, "must be > 0 (the references use 2e-6)"))


GUARD = Guard("guard", "GRPO-Guard's", fields=("latents", "sigmas"),
              config_keys=("ratio_norm", "sde_type", "guard_stats", "guard_clip_range"))
