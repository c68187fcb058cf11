"""Rollout correction: verl's `verl/trainer/ppo/rollout_corr_helper.py` (importance-sampling weights `rollout_is`,
rejection masks `rollout_rs`) for diffusion, a sample's window steps being verl's tokens and the sample its sequence.
Two modes, as verl's:

- train.old_log_prob="rollout_corrected", bypass mode as verl-omni runs it (`verl_omni/workers/utils/losses.py`
  `_apply_bypass_rc`, loss_type ppo_clip): logp_old is the rollout's; a window step whose log_ratio = logp -
  logp_rollout (the current policy's) fails the token-level estimator train.rollout_rs at train.rejection_threshold
  is rejected. No IS weights: the PPO ratio exp(logp - logp_rollout) is the IS ratio.
- train.old_log_prob="recompute_corrected", decoupled mode (verl's default): logp_old is the recompute pass's (every
  row, before the first update), and from log_ratio = logp_old - logp_rollout (B, W) the truncated IS weights
  (train.rollout_is "token" / "sequence", train.rollout_is_threshold) and the rejection mask (any train.rollout_rs,
  sequence-level ones over the sample's W window steps) weigh each window step's policy term, detached.

A rejected window step's policy term is weighted 0 (no gradient) but stays in the loss's denominator, and its KL
term is kept, as in verl-omni. docs/numerics.md §11."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow.algorithms.old_log_prob import Source

SAFETY_BOUND = 20.0  # verl's clamp of the log-ratio before the estimators
# train.rollout_rs' choices: verl's estimators, each with what t bounds; k1 = -log_ratio, k2 = log_ratio^2 / 2,
# k3 = exp(log_ratio) - 1 - log_ratio per window step; seq_*: their sum / mean / max over a sample's window steps
TOKEN_RS = {"token_k1": "exp(log_ratio) in [1/t, t], t > 1", "token_k2": "log_ratio^2 / 2 <= t, t > 0",
            "token_k3": "exp(log_ratio) - 1 - log_ratio <= t, t > 0"}
SEQUENCE_RS = {"seq_sum_k1": "exp(sum log_ratio) in [1/t, t], t > 1", "seq_sum_k2": "sum k2 <= t, t > 0",
               "seq_sum_k3": "sum k3 <= t, t > 0", "seq_mean_k1": "exp(mean log_ratio) in [1/t, t], t > 1",
               "seq_mean_k2": "mean k2 <= t, t > 0", "seq_mean_k3": "mean k3 <= t, t > 0",
               "seq_max_k2": "max k2 <= t, t > 0", "seq_max_k3": "max k3 <= t, t > 0"}
RS_OPTIONS = {**TOKEN_RS, **SEQUENCE_RS}
IS_OPTIONS = {"off": "no IS weights", "token": "min(exp(log_ratio), t) per window step",
              "sequence": "min(exp(sum of the sample's log_ratio), t) on each of its window steps"}


def _estimator(lr, k: str):
    return {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": jnp.exp(lr) - 1.0 - lr}[k]


def _passes(stat, k: str, threshold: float):
    if k == "k1":  # verl's lower bound 1/t on the ratio: the statistic -log_ratio in [log(1/t), log t]
        upper = float(np.log(threshold))
        return (stat >= -upper) & (stat <= upper)
    return stat <= threshold


def keep_mask(log_ratio, option: str, threshold: float):
    """bool, log_ratio's shape: the window steps verl's `option` keeps at `threshold`. Token-level options act per
    element (any shape); sequence-level ones (seq_sum/seq_mean/seq_max) aggregate over the last axis, a sample's
    window steps (B, W), and keep or reject all of them."""
    if option not in RS_OPTIONS:
        raise ValueError(f"rollout_rs {option!r}: choose one of {sorted(RS_OPTIONS)}")
    stat = _estimator(jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND), option[-2:])
    if option in TOKEN_RS:
        return _passes(stat, option[-2:], threshold)
    reduce = {"seq_sum": jnp.sum, "seq_mean": jnp.mean, "seq_max": jnp.max}[option[:-3]]
    seq = _passes(reduce(stat, axis=-1, keepdims=True), option[-2:], threshold)
    return jnp.broadcast_to(seq, log_ratio.shape)


def is_weights(log_ratio, mode: str, threshold: float):
    """(B, W) float32: verl's truncated IS weights of log_ratio (B, W) (a sample's window steps on the last axis),
    detached: token min(exp(clip(log_ratio)), t); sequence min(exp(clip(sum over the sample)), t) on each step."""
    if mode == "token":
        lr = log_ratio
    elif mode == "sequence":
        lr = jnp.broadcast_to(jnp.sum(log_ratio, axis=-1, keepdims=True), log_ratio.shape)
    else:
        raise ValueError(f"rollout_is {mode!r}: choose one of {sorted(IS_OPTIONS)}")
    w = jnp.minimum(jnp.exp(jnp.clip(lr, -SAFETY_BOUND, SAFETY_BOUND)), threshold)
    return jax.lax.stop_gradient(w.astype(jnp.float32))


def _rs_rules(config, options: dict, allow_off: bool):
    choices = ", ".join(f"{k!r} ({v})" for k, v in options.items()) + (", 'off'" if allow_off else "")
    off = allow_off and config.rollout_rs == "off"
    bound = 1.0 if config.rollout_rs.endswith("k1") else 0.0
    return (("rollout_rs", not off and config.rollout_rs not in options,
             f"choose {choices}" + ("" if allow_off else "; sequence-level options need "
                                    "old_log_prob='recompute_corrected'")),
            ("rejection_threshold", not off and not config.rejection_threshold > bound,
             f"must be > {bound:g} for rollout_rs={config.rollout_rs!r} ({RS_OPTIONS.get(config.rollout_rs)})"))


@dataclasses.dataclass(frozen=True)
class Corrected(Source):
    """Bypass mode: the current policy's window step against the rollout's, token-level rejection only."""

    def rejection(self, config):
        return functools.partial(keep_mask, option=config.rollout_rs, threshold=config.rejection_threshold)

    def rules(self, config, policy):
        return (*_rs_rules(config, TOKEN_RS, allow_off=False),
                ("rollout_is", config.rollout_is != "off",
                 "must be 'off' with old_log_prob='rollout_corrected' (bypass: the PPO ratio exp(logp - "
                 "logp_rollout) is the IS ratio, as verl's ppo_clip); IS weights need 'recompute_corrected'"))


@dataclasses.dataclass(frozen=True)
class Decoupled(Source):
    """Decoupled mode: IS weights and rejection from the recompute pass's logp_old against the rollout's."""

    def weigh(self, batch: dict, config) -> dict:
        log_ratio = batch["old_log_probs"] - batch["log_probs"]
        keep = jnp.ones(log_ratio.shape, bool)
        if config.rollout_rs != "off":
            keep = jax.lax.stop_gradient(keep_mask(log_ratio, config.rollout_rs, config.rejection_threshold))
        weight = jnp.ones(log_ratio.shape, jnp.float32)
        if config.rollout_is != "off":
            weight = is_weights(log_ratio, config.rollout_is, config.rollout_is_threshold)
        return {**batch, "rc_weights": weight, "rc_keep": keep}

    def rules(self, config, policy):
        return (*_rs_rules(config, RS_OPTIONS, allow_off=True),
                ("rollout_is", config.rollout_is not in IS_OPTIONS,
                 "choose " + ", ".join(f"{k!r} ({v})" for k, v in IS_OPTIONS.items())),
                ("rollout_is_threshold", config.rollout_is != "off" and not config.rollout_is_threshold > 0,
                 "must be > 0: the IS weights' truncation (verl's default 2.0)"),
                ("rollout_is", config.rollout_is == "off" and config.rollout_rs == "off",
                 "set rollout_is or rollout_rs with 'recompute_corrected' (both 'off' is old_log_prob='recompute')"))


ROLLOUT_CORRECTED = Corrected("rollout_corrected", "the engine's, rejecting window steps by rollout_rs (bypass)",
                              fields=("log_probs",),
                              config_keys=("old_log_prob", "rollout_rs", "rejection_threshold", "rollout_is"))
RECOMPUTE_CORRECTED = Decoupled("recompute_corrected", "the trainer's, IS-weighted / rejected against the engine's "
                                "by rollout_is / rollout_rs (decoupled)", fields=("log_probs",),
                                config_keys=("old_log_prob", "off_policy", "rollout_rs", "rejection_threshold",
                                             "rollout_is", "rollout_is_threshold"),
                                recompute=True, from_rollout=False, every_row=True)
