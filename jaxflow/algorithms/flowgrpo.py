"""FlowGRPO algorithm (docs/design.md §2, docs/numerics.md §4-5; flow_grpo `scripts/train_qwenimage.py`): true-CFG
velocity, and the clipped policy objective (+ KL to the adapters-off reference) of one SDE window step, on the
ratio `RATIOS` names (FlowGRPO's plain one here, GRPO-Guard's in `grpo_guard`).

Pure functions. Their accumulation over micro-batches and window steps is `flowgrpo_step`; group advantages are
`advantages`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxflow.algorithms import sde
from jaxflow.algorithms import grpo_guard
from jaxflow.algorithms.base import Component
from jaxflow_bridge.contract.batch import CONDITION_FIELDS, GUIDANCE_FIELDS, TEXT_IDS


def paired(a: jax.Array, b: jax.Array) -> jax.Array:
    """(B, ...) twice -> (2B, ...), row 2i a[i] and row 2i+1 b[i]: CFG's batched call with each sample's positive and
    negative rows side by side, so a batch split over devices stays on its devices (joining [a; b] along the batch
    would move half of each device's rows to another: an all-to-all in every guided forward and its gradient)."""
    return jnp.stack([a, b], axis=1).reshape(-1, *a.shape[1:])


def guided_velocity(model, x, sigma, txt, txt_mask, neg_txt=None, neg_mask=None, *, grid_hw, guidance: float,
                    lora_scale: float = 1.0) -> jax.Array:
    """Velocity (B, S, C) float32; true CFG with norm rescale when guidance > 1 (docs/numerics.md §5).

    Positive and negative prompts of one text length (the train batch's `config.text_tokens`, padded where the
    rollout made them) run as ONE batched call, or as two calls where the negative text is padded shorter than the
    positive (sample.negative_max_sequence_length): each call then spends its tokens on its own text. A negative
    longer than the positive is a ValueError (the config refuses it). comb = v_neg + g (v_pos - v_neg),
    v = comb * |v_pos| / |comb| (norms over channels). guidance <= 1: one positive pass, no negative needed.
    `guidance` is static (a Python float).
    """
    if guidance <= 1:
        return model(x, sigma, txt, txt_mask, grid_hw=grid_hw, lora_scale=lora_scale).astype(jnp.float32)
    if neg_txt is None or neg_mask is None:
        raise ValueError(f"guidance {guidance} > 1 (true CFG) needs negative prompt embeds and mask")
    neg_txt = neg_txt.astype(txt.dtype)
    if neg_txt.shape[1] < txt.shape[1]:
        v_pos = model(x, sigma, txt, txt_mask, grid_hw=grid_hw, lora_scale=lora_scale).astype(jnp.float32)
        v_neg = model(x, sigma, neg_txt, neg_mask, grid_hw=grid_hw, lora_scale=lora_scale).astype(jnp.float32)
    elif neg_txt.shape[1] > txt.shape[1]:
        raise ValueError(f"negative prompt text of {neg_txt.shape[1]} tokens > the prompt's {txt.shape[1]}: the "
                         f"train batch pads negatives to at most the prompts' length (config.text_tokens)")
    else:
        both = model(paired(x, x), paired(sigma, sigma), paired(txt, neg_txt), paired(txt_mask, neg_mask),
                     grid_hw=grid_hw, lora_scale=lora_scale).astype(jnp.float32)
        both = both.reshape(-1, 2, *both.shape[1:])
        v_pos, v_neg = both[:, 0], both[:, 1]
    comb = v_neg + guidance * (v_pos - v_neg)
    return comb * (jnp.linalg.norm(v_pos, axis=-1, keepdims=True) / jnp.linalg.norm(comb, axis=-1, keepdims=True))


def window_steps(mb: dict) -> tuple[dict, dict]:
    """Split a per-sample micro-batch into per-window-step inputs (leading W axis) and inputs shared by all steps
    (the train step's, `jaxflow.trainer.train_step`, for every model kind)."""
    sigmas, idx = mb["sigmas"], mb["step_index"].T  # (b, N+1), (W, b)
    rows = jnp.arange(sigmas.shape[0])[None]
    latents = jnp.swapaxes(mb["latents"], 0, 1)
    per_step = {"x": latents[:-1], "x_next": latents[1:], "sigma": sigmas[rows, idx],
                "sigma_next": sigmas[rows, idx + 1]}
    if "log_probs" in mb:
        per_step["rollout_log_prob"] = mb["log_probs"].T
    if "old_log_probs" in mb:
        per_step["old_log_prob"] = mb["old_log_probs"].T
    if "rc_keep" in mb:  # decoupled rollout correction's (B, W), `rollout_correction.Decoupled`
        per_step["rc_weight"], per_step["rc_keep"] = mb["rc_weights"].T, mb["rc_keep"].T
    if "old_means" in mb:
        per_step["old_mean"] = jnp.swapaxes(mb["old_means"], 0, 1)
    text = ("prompt_embeds", "prompt_mask", *GUIDANCE_FIELDS, *TEXT_IDS.values())
    shared = {k: mb[k] for k in ("noise_level", "advantages", *text, *CONDITION_FIELDS) if k in mb}
    return per_step, {**shared, "sigma_max": sigmas[:, 1]}


def clipped_objective(log_prob, old_log_prob, advantages, clip_range: float, adv_clip: float):
    """Per-sample PPO terms max(-A r, -A clip(r, 1-eps, 1+eps)) (B,) and the ratio r = exp(logp - logp_old)."""
    ratio = jnp.exp(log_prob - old_log_prob)
    adv = jnp.clip(advantages, -adv_clip, adv_clip)
    terms = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1.0 - clip_range, 1.0 + clip_range))
    return terms, ratio


def window_log_prob(model, tr: dict, *, grid_hw, sde_type: str, guidance: float, lora_scale: float = 1.0):
    """(mean, log_prob, std) of the stored next latent under the policy's SDE step (B, ...), CFG as in sampling.

    `tr`, a batch of transitions x -> x_next of one window step, holds x, x_next (B, S, C); sigma, sigma_next,
    sigma_max, noise_level (B,); prompt_embeds / prompt_mask and, for CFG, negative_prompt_embeds /
    negative_prompt_mask."""
    text = (tr["prompt_embeds"], tr["prompt_mask"], tr.get("negative_prompt_embeds"),
            tr.get("negative_prompt_mask"))
    v = guided_velocity(model, tr["x"], tr["sigma"], *text, grid_hw=grid_hw, guidance=guidance,
                        lora_scale=lora_scale)
    _, logp, mean, std = sde.sde_step(tr["x"], v, tr["sigma"], tr["sigma_next"], tr["sigma_max"],
                                      sde_type=sde_type, noise_level=tr["noise_level"], prev_sample=tr["x_next"])
    return mean, logp, std


def window_step_terms(model, tr: dict, *, grid_hw, sde_type: str, guidance: float, clip_range: float,
                      adv_clip: float, beta: float, reject=None,
                      ratio_norm: str = "none", guard_stats: str = "sample", log_prob=None) -> dict:
    """Per-sample terms (B,) of one window step: policy, kl, ratio, log_ratio = logp - logp_old and
    dlogp = logp - logp_rollout.

    `tr` holds what `window_log_prob` reads, advantages and rollout_log_prob (B,), and optionally
    old_log_prob (B,); without it, or where the scalar flag old_on_policy is set, logp_old is the trainer's own logp
    under stop_gradient (exactly on-policy: ratio 1). The loss of the step is mean(policy) + beta * mean(kl) (over
    all samples, see `window_loss`). The KL reference is the same model with adapters off (lora_scale 0) under
    stop_gradient. `reject` (rollout correction, `rollout_correction.keep_mask`): `keep` marks the samples it
    keeps from logp - logp_rollout; the others' policy term is 0 (no gradient; still counted, KL kept). With
    rc_weight / rc_keep (B,) in `tr` (decoupled rollout correction) the policy term is weighted and kept by them.

    ratio_norm: the ratio's name in `RATIOS` ("guard": GRPO-Guard's, `grpo_guard.Guard`, its scale and dt per
    sample or per micro-batch by guard_stats).

    `log_prob(model, tr, lora_scale=1.0) -> (mean, logp, std)`: another model kind's window log-prob
    (`jaxflow.algorithms.objective`; grid_hw, sde_type and guidance are then its own); default `window_log_prob`.
    """
    if log_prob is None:
        log_prob = functools.partial(window_log_prob, grid_hw=grid_hw, sde_type=sde_type, guidance=guidance)
    mean, logp, std = log_prob(model, tr)
    old = tr["old_log_prob"] if "old_log_prob" in tr else jax.lax.stop_gradient(logp)
    if "old_on_policy" in tr:  # a traced flag: this update is on-policy whatever old_log_prob holds
        old = jnp.where(tr["old_on_policy"], jax.lax.stop_gradient(logp), old)
    log_ratio = logp - old
    new, base, divisor = RATIOS[ratio_norm].normalized(tr, mean, logp, std, old, log_ratio, sde_type,
                                                    stats=guard_stats)
    policy, ratio = clipped_objective(new, base, tr["advantages"], clip_range, adv_clip)
    if divisor is not None:
        policy = policy / divisor
    dlogp = logp - tr["rollout_log_prob"]
    keep = None if reject is None else jax.lax.stop_gradient(reject(dlogp))
    if "rc_keep" in tr:  # decoupled rollout correction: the step's IS weight and keep, detached
        keep = tr["rc_keep"]
        policy = policy * tr["rc_weight"]
    if keep is not None:
        policy = jnp.where(keep, policy, 0.0)
    kl = jnp.zeros_like(policy)
    if beta > 0:
        ref_mean = jax.lax.stop_gradient(log_prob(model, tr, lora_scale=0.0)[0])
        kl = sde.kl_term(mean, ref_mean, std)
    terms = {"policy": policy, "kl": kl, "ratio": ratio, "log_ratio": log_ratio, "dlogp": dlogp}
    if keep is not None:
        terms["keep"] = keep
    return terms


@dataclasses.dataclass(frozen=True)
class PlainRatio(Component):
    """FlowGRPO's ratio exp(logp - logp_old)."""

    old_means: bool = False

    def clip_range(self, config) -> float:
        return config.clip_range

    def normalized(self, tr, mean, logp, std, old, log_ratio, sde_type, stats="sample"):
        return logp, old, None


PLAIN = PlainRatio("none", "FlowGRPO's ratio", fields=("log_probs",),
                   config_keys=("ratio_norm", "clip_range", "adv_clip"))
RATIOS = {r.name: r for r in (PLAIN, grpo_guard.GUARD)}  # train.ratio_norm's choices


def window_loss(terms: dict, beta: float, weight=None):
    """mean(policy) + beta * mean(kl) over a window step's samples (rollout correction's rejected ones among them,
    their policy term 0, as verl-omni weights them); with `weight` (B,) the weighted sum of policy + beta * kl
    instead (the row filter's weights, `zero_advantage`)."""
    if weight is None:
        return jnp.mean(terms["policy"]) + beta * jnp.mean(terms["kl"])
    return jnp.sum(weight * (terms["policy"] + beta * terms["kl"]))


def step_metrics(terms: dict, *, clip_range: float, beta: float) -> dict:
    """Scalar metrics from per-sample terms stacked as (..., W, B_micro) (window step on the second-last axis).
    ratio_* / clipfrac* / approx_kl = 1/2 mean(log_ratio^2) compare the policy with logp_old (what the clip acts
    on); logp_diff_mean / logp_diff_max are (W,): |logp - logp_rollout| per window step (rollout-trainer
    mismatch); with rollout correction, rejected_frac = the share of samples x window steps rejected (`keep`
    False). An optional `mask` term (same shape, bool; all True without it) keeps only the samples that trained
    (drop_zero_advantage: the rows whose advantage is not 0); with none of them, the means are 0 and the ratio's
    extremes 1."""
    ratio, dlogp = terms["ratio"], terms["dlogp"]
    given = terms.get("mask")

    def mask_of(x):
        return jnp.ones(x.shape, bool) if given is None else given

    def mean(x):
        return jnp.sum(jnp.where(mask_of(x), x, 0)) / jnp.maximum(jnp.sum(mask_of(x)), 1)

    def lo(x):
        return jnp.where(jnp.any(mask_of(x)), jnp.min(jnp.where(mask_of(x), x, jnp.inf)), 1.0)

    def hi(x):
        return jnp.where(jnp.any(mask_of(x)), jnp.max(jnp.where(mask_of(x), x, -jnp.inf)), 1.0)

    steps = dlogp.shape[-2]
    per_step = jnp.moveaxis(jnp.where(mask_of(dlogp), jnp.abs(dlogp), 0.0), -2, 0).reshape(steps, -1)
    step_mask = jnp.moveaxis(mask_of(dlogp), -2, 0).reshape(steps, -1)
    step_mean = jnp.sum(per_step, axis=1) / jnp.maximum(jnp.sum(step_mask, axis=1), 1)
    step_max = jnp.max(per_step, axis=1)
    policy, kl = mean(terms["policy"]), mean(terms["kl"])
    extra = {"rejected_frac": mean(~terms["keep"])} if "keep" in terms else {}
    return {**extra,
        "loss": policy + beta * kl,
        "policy_loss": policy,
        "kl": kl,
        "approx_kl": 0.5 * mean(terms["log_ratio"] ** 2),
        "clipfrac": mean(jnp.abs(ratio - 1.0) > clip_range),
        "clipfrac_gt_one": mean(ratio > 1.0 + clip_range),
        "clipfrac_lt_one": mean(ratio < 1.0 - clip_range),
        "ratio_mean": mean(ratio),
        "ratio_min": lo(ratio),
        "ratio_max": hi(ratio),
        "logp_diff_mean": step_mean,
        "logp_diff_max": step_max,
    }
