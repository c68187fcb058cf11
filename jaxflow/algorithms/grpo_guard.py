"""GRPO-Guard's ratio (train.ratio_norm="guard"; arXiv 2510.22319, as verl-omni's `grpo_guard` loss, per sample
here), used by FlowGRPO's clipped objective (`flowgrpo.window_step_terms`)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxflow.algorithms.base import Component


@dataclasses.dataclass(frozen=True)
class Guard(Component):
    """With the step std s = std_dev_t sqrt(dt) ('cps': its std) and dt = sigma - sigma_next, the ratio is
    exp(s (logp - logp_old + mean((mu - mu_old)^2) / (2 s^2))), which is exp(mean((mu - mu_old) eps)) for the
    sampled noise eps: the same scale at every step; the policy term is divided by dt. mu_old: tr["old_mean"]
    (the recompute pass), or mu under stop_gradient where the update is on-policy (ratio exactly 1)."""

    old_means: bool = True

    def normalized(self, tr, mean, logp, std, old, log_ratio, sde_type):
        old_mean = tr["old_mean"] if "old_mean" in tr else jax.lax.stop_gradient(mean)
        if "old_on_policy" in tr:
            old_mean = jnp.where(tr["old_on_policy"], jax.lax.stop_gradient(mean), old_mean)
        dt = tr["sigma"] - tr["sigma_next"]
        step_std = std * jnp.sqrt(dt) if sde_type == "sde" else std
        drift = jnp.mean(jnp.square(mean - old_mean).reshape(mean.shape[0], -1), axis=1)
        return step_std * (log_ratio + drift / (2 * step_std ** 2)), 0.0, dt

    def rules(self, config, policy):
        return (("ratio_norm", not policy.old_log_prob.recompute,
                 f"'guard' needs old_log_prob='recompute' (got {config.old_log_prob!r}): the old policy's SDE means "
                 f"come from the trainer's pass"),)


GUARD = Guard("guard", "GRPO-Guard's", fields=("latents", "sigmas"), config_keys=("ratio_norm", "sde_type"))
