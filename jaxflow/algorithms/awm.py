"""Advantage Weighted Matching (AWM; Xue et al., arXiv 2509.25050; scxue/advantage_weighted_matching
`advantage_weighted_matching/scripts/train_sd3_awm.py`), docs/numerics.md §13: the flow-matching loss of the
pretraining objective, weighted by the advantage. No SDE log-probs: the rollout's final latents x0 are noised afresh,
x_t = (1 - t) x0 + t eps, at `awm_timesteps` step indices of the sampling schedule drawn one per stratum (its
"discrete_wo_init"), and the matching error against the target eps - x0 plays the log-prob in PPO's clipped
objective (its "exp_first" loss, one ratio per sample and timestep).

Pure loss terms; `gradients` accumulates them over a mini-batch inside the train step through the registered
component `AWM`."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxflow.algorithms import flowgrpo, forward_process, nft
from jaxflow_bridge.contract.batch import CONDITION_FIELDS, GUIDANCE_FIELDS

SALT = 0x61776D  # folded into the seed's key for the timesteps and noise
EPS = 1e-10  # the generalized Huber's offset (AWM's)


def matching_log_prob(v, x0, noise, t, power: float):
    """AWM's log-prob surrogate (B,) with its generalized-Huber weighting ("ghuber"): -((d + eps)^p - eps^p) t / p,
    d = mean((v - (noise - x0))^2) over a sample's elements."""
    d = jnp.mean(jnp.square(v - (noise - x0)).reshape(v.shape[0], -1), axis=1)
    return -(jnp.power(d + EPS, power) - EPS ** power) * t / power


def step_indices(key, num_steps: int, count: int, fraction: float):
    """(count,) schedule indices, one per stratum of [1, int(num_steps * fraction)] (shared by the micro-batch)."""
    edges = jnp.linspace(1, int(num_steps * fraction), count + 1).astype(jnp.int32)
    lo, hi = edges[:-1], edges[1:]
    return lo + (jax.random.uniform(key, (count,)) * (hi - lo)).astype(jnp.int32)


def loss_terms(v, x0, noise, t, advantages, *, power: float, adv_clip: float, adv_max: float,
               clip_range: float, v_ref=None, logp_old=None) -> dict:
    """Per-sample terms (B,) of one noised timestep: policy = max(-a r, -a clip(r, 1 - e, 1 + e)) with
    r = exp(logp - logp_old) (logp_old: stop_gradient(logp) unless given), a = clip(A, +-adv_clip) / adv_clip *
    adv_max; kl = mean((v - v_ref)^2) (zeros without v_ref); ratio. The loss of a timestep is mean(policy) + beta
    mean(kl)."""
    v = v.astype(jnp.float32)
    logp = matching_log_prob(v, x0, noise, t, power)
    old = jax.lax.stop_gradient(logp if logp_old is None else logp_old)
    ratio = jnp.exp(logp - old)
    a = jnp.clip(advantages, -adv_clip, adv_clip) / adv_clip * adv_max
    policy = jnp.maximum(-a * ratio, -a * jnp.clip(ratio, 1 - clip_range, 1 + clip_range))
    kl = jnp.zeros_like(policy) if v_ref is None else jnp.mean(
        jnp.square(v - jax.lax.stop_gradient(v_ref.astype(jnp.float32))).reshape(v.shape[0], -1), axis=1)
    return {"policy": policy, "kl": kl, "ratio": jax.lax.stop_gradient(ratio)}


def _loss(lora, frozen, step, scale, *, graphdef, config, objective):
    xt = nft.noised(step["final_latents"], step["noise"], step["t"])
    model = objective.velocity(nnx.merge(graphdef, lora, frozen), step)

    def velocity(lora_scale):  # with CFG as the rollout samples (its train.cfg)
        return flowgrpo.guided_velocity(model, xt, step["t"], step["prompt_embeds"], step["prompt_mask"],
                                        step.get("negative_prompt_embeds"), step.get("negative_prompt_mask"),
                                        grid_hw=config.grid_hw, guidance=config.guidance, lora_scale=lora_scale)

    v_ref = velocity(0.0) if config.beta > 0 else None
    terms = loss_terms(velocity(1.0), step["final_latents"], step["noise"], step["t"], step["advantages"],
                       power=config.awm_power, adv_clip=config.adv_clip, adv_max=config.awm_adv_max,
                       clip_range=config.awm_clip_range, v_ref=v_ref)
    return (jnp.mean(terms["policy"]) + config.beta * jnp.mean(terms["kl"])) * scale, terms


def gradients(graphdef, lora, frozen, batch: dict, key, config, layout=None, *, objective):
    """Sum over micro-batches and timesteps of grad(loss / (M * T)) wrt `lora` and the terms stacked (M, T, B/M);
    `objective` (the family's) conditions the model on the micro-batch's `CONDITION_FIELDS`."""
    def loss(params, step, scale):
        return _loss(params, frozen, step, scale, graphdef=graphdef, config=config, objective=objective)

    def pick(key, sigmas, count):
        return sigmas[:, step_indices(key, sigmas.shape[1] - 1, count, config.awm_fraction)]

    return forward_process.timestep_gradients(
        loss, lora, batch, key, num_micro_batches=config.num_micro_batches, count=config.awm_timesteps, pick=pick,
        fields=("final_latents", "advantages", "prompt_embeds", "prompt_mask", *GUIDANCE_FIELDS, *CONDITION_FIELDS),
        layout=layout)


@dataclasses.dataclass(frozen=True)
class AdvantageWeightedMatching(forward_process.ForwardProcessLoss):
    """AWM on the rollout's final latents, awm_timesteps noised timesteps a micro-batch; on-policy (logp_old is
    each update's own logp, ratio 1: the reference's OCR recipe takes one optimizer step a rollout)."""

    keeps_old: bool = False

    def batch_fields(self, config) -> tuple[str, ...]:
        return self.fields + (GUIDANCE_FIELDS if config.guided else ())

    def update(self, state, frozen, mb: dict, old, index, *, graphdef, config, layout, objective):
        grads, terms = gradients(graphdef, state.lora, frozen, mb, self.update_key(config, state.step), config, layout,
                                 objective=objective)
        policy, kl = jnp.mean(terms["policy"]), jnp.mean(terms["kl"])
        metrics = {"loss": policy + config.beta * kl, "policy_loss": policy, "kl": kl,
                   "ratio_mean": jnp.mean(terms["ratio"])}
        return grads, metrics, None

    def passes(self, config, window: int) -> tuple[int, int]:
        """Each noised timestep's guided velocity (two passes with true CFG) trained; with a KL the adapters-off
        one beside it."""
        guided = config.awm_timesteps * (2 if config.guided else 1)
        return guided, guided if config.beta > 0 else 0

    def rules(self, config, policy):
        return (
            ("old_log_prob", policy.old_log_prob.rejection(config) is not None,
             "corrects SDE log-probs; AWM has none: 'rollout'"),
            ("ratio_norm", policy.ratio.name != "none", "is a FlowGRPO ratio; AWM has its own: 'none'"),
            ("drop_zero_advantage", policy.filter.compacts, "not an AWM option: False"),
            ("awm_timesteps", config.awm_timesteps < 1, "must be >= 1"),
            ("awm_fraction", not 0 < config.awm_fraction <= 1, "must be in (0, 1]"),
            ("awm_power", not config.awm_power > 0, "must be > 0"),
            ("awm_adv_max", not config.awm_adv_max > 0, "must be > 0"),
            ("awm_clip_range", not config.awm_clip_range > 0, "must be > 0"))


AWM = AdvantageWeightedMatching(
    "awm", "Advantage Weighted Matching on the forward process", fields=nft.FIELDS, salt=SALT,
    config_keys=("algorithm", "awm_timesteps", "awm_fraction", "awm_power", "awm_adv_max", "awm_clip_range",
                 "adv_clip", "beta", "guidance", "shuffle_seed", "num_micro_batches"))
