"""Rollout correction (train.old_log_prob="rollout_corrected"): verl's rollout-correction bypass mode with rejection
sampling (RS), as verl-omni runs it for diffusion (`verl_omni/workers/utils/losses.py` `_apply_bypass_rc`, on verl's
`verl/trainer/ppo/rollout_corr_helper.py` `compute_rollout_rejection_mask`). logp_old is the rollout's; a diffusion
step is a token. A sample's window step whose divergence between the policy and the rollout, from
log_ratio = logp - logp_rollout, passes train.rejection_threshold t is rejected: its policy term is weighted 0 (no
gradient) but it stays in the loss's denominator, and its KL term is kept, as in verl-omni. docs/numerics.md."""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from jaxflow.algorithms.old_log_prob import Source

SAFETY_BOUND = 20.0  # verl's clamp of the log-ratio before the estimators
# train.rollout_rs' choices: verl's token-level estimators, each with what t bounds
RS_OPTIONS = {"token_k1": "exp(log_ratio) in [1/t, t], t > 1", "token_k2": "log_ratio^2 / 2 <= t, t > 0",
              "token_k3": "exp(log_ratio) - 1 - log_ratio <= t, t > 0"}


def keep_mask(log_ratio, option: str, threshold: float):
    """(B,) bool: the window steps verl's `option` keeps at `threshold` (log_ratio = logp - logp_rollout (B,)).
    token_k1 with one number t keeps -log_ratio in [log(1/t), log t] (verl's lower bound 1/t)."""
    lr = jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    if option == "token_k1":
        upper = float(np.log(threshold))
        return (-lr >= -upper) & (-lr <= upper)
    if option == "token_k2":
        return 0.5 * lr ** 2 <= threshold
    if option == "token_k3":
        return jnp.exp(lr) - 1.0 - lr <= threshold
    raise ValueError(f"rollout_rs {option!r}: choose one of {sorted(RS_OPTIONS)}")


@dataclasses.dataclass(frozen=True)
class Corrected(Source):
    def rejection(self, config):
        return functools.partial(keep_mask, option=config.rollout_rs, threshold=config.rejection_threshold)

    def rules(self, config, policy):
        bound = 1.0 if config.rollout_rs == "token_k1" else 0.0
        return (("rollout_rs", config.rollout_rs not in RS_OPTIONS,
                 "choose " + ", ".join(f"{k!r} ({v})" for k, v in RS_OPTIONS.items())),
                ("rejection_threshold", not config.rejection_threshold > bound,
                 f"must be > {bound:g} for rollout_rs={config.rollout_rs!r} ({RS_OPTIONS.get(config.rollout_rs)})"))


ROLLOUT_CORRECTED = Corrected("rollout_corrected", "the engine's, rejecting window steps by rollout_rs",
                              fields=("log_probs",),
                              config_keys=("old_log_prob", "rollout_rs", "rejection_threshold"))
