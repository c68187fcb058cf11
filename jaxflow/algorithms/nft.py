"""DiffusionNFT (arXiv 2509.16117; NVlabs/DiffusionNFT `scripts/train_nft_sd3.py`), docs/numerics.md §10: policy
optimization on the forward process. No SDE log-probs: the final latents x0 of the rollout are noised afresh at
timesteps of the sampling schedule, x_t = (1 - t) x0 + t eps, and the policy's velocity v is pulled toward an
implicit positive policy on high-reward samples and away from an implicit negative one on low-reward samples, both
built around the "old" policy that sampled (a slowly moving copy of the LoRA, `old_decay`).

The loss terms are pure functions; `gradients` accumulates them over a mini-batch and `advanced` moves the
old policy, both inside `jaxflow.trainer.train_step`'s jitted functions through the registered component `NFT`.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxflow.algorithms import forward_process
from jaxflow_bridge.contract.batch import CONDITION_FIELDS

FIELDS = ("final_latents", "sigmas", "prompt_embeds", "prompt_mask", "advantages")
SALT = 0x6E6674  # folded into the seed's key for the timesteps and noise (apart from the epochs' shuffles)
WEIGHT_FLOOR = 1e-5  # the adaptive weight's lower clip (DiffusionNFT's)


def noised(x0, noise, t):
    """x_t = (1 - t) x0 + t noise; x0, noise (B, S, C), t (B,)."""
    t = t.reshape(-1, *([1] * (x0.ndim - 1)))
    return (1 - t) * x0 + t * noise


def _per_sample_mean(x):
    return jnp.mean(x.reshape(x.shape[0], -1), axis=1)


def _x0_loss(v, xt, x0, t):
    """Adaptively weighted x0-regression loss (B,): mean((x0_hat - x0)^2) / sg(max(mean|x0_hat - x0|, floor)),
    x0_hat = x_t - t v."""
    err = xt - t.reshape(-1, *([1] * (xt.ndim - 1))) * v - x0
    weight = jax.lax.stop_gradient(jnp.maximum(_per_sample_mean(jnp.abs(err)), WEIGHT_FLOOR))
    return _per_sample_mean(jnp.square(err)) / weight


def optimality(advantages, adv_clip: float):
    """r in [0, 1] (B,): the clipped advantage mapped linearly, -adv_clip -> 0, 0 -> 1/2, adv_clip -> 1."""
    return jnp.clip(jnp.clip(advantages, -adv_clip, adv_clip) / adv_clip / 2 + 0.5, 0.0, 1.0)


def loss_terms(v, v_old, x0, xt, t, advantages, *, nft_beta: float, adv_clip: float, v_ref=None) -> dict:
    """Per-sample terms (B,) of one noised timestep: policy, kl and old_deviate.

    v+ = beta v + (1 - beta) v_old and v- = (1 + beta) v_old - beta v (v_old under stop_gradient); policy =
    adv_clip (r L(v+) + (1 - r) L(v-)) / beta with L `_x0_loss` and r = `optimality(A)`. kl = mean((v - v_ref)^2),
    v_ref the adapters-off velocity (zeros without it); old_deviate = mean((v - v_old)^2), for the metrics. The
    loss of a timestep is mean(policy) + train.beta mean(kl)."""
    v, v_old = v.astype(jnp.float32), jax.lax.stop_gradient(v_old.astype(jnp.float32))
    positive = nft_beta * v + (1 - nft_beta) * v_old
    negative = (1 + nft_beta) * v_old - nft_beta * v
    r = optimality(advantages, adv_clip)
    policy = adv_clip * (r * _x0_loss(positive, xt, x0, t) + (1 - r) * _x0_loss(negative, xt, x0, t)) / nft_beta
    kl = jnp.zeros_like(policy) if v_ref is None else _per_sample_mean(
        jnp.square(v - jax.lax.stop_gradient(v_ref.astype(jnp.float32))))
    return {"policy": policy, "kl": kl, "old_deviate": jax.lax.stop_gradient(_per_sample_mean(jnp.square(v - v_old)))}


def old_decay(updates, flat: int, rate: float, cap: float):
    """The old policy's decay after `updates` optimizer updates: 0 (old = the LoRA) for the first `flat`, then
    rate per update up to `cap`. After each step old <- decay old + (1 - decay) LoRA (DiffusionNFT's
    `return_decay`; its OCR recipe: 75, 0.0075, 0.999)."""
    grown = (jnp.asarray(updates, jnp.float32) - flat) * rate
    return jnp.where(updates < flat, 0.0, jnp.minimum(grown, cap))


def timestep_picks(key, sigmas, count: int):
    """(B, count) sigmas, each row `count` distinct timesteps of its sample's schedule (the N nonzero sigmas of
    sigmas (B, N + 1)) drawn without replacement, as DiffusionNFT shuffles the schedule per sample."""
    n = sigmas.shape[1] - 1
    order = jnp.argsort(jax.random.uniform(key, (sigmas.shape[0], n)), axis=1)[:, :count]
    return jnp.take_along_axis(sigmas[:, :n], order, axis=1)


def step_metrics(terms: dict, beta: float) -> dict:
    """Scalar metrics from per-sample terms stacked as (micro-batches, timesteps, B_micro)."""
    policy, kl = jnp.mean(terms["policy"]), jnp.mean(terms["kl"])
    return {"loss": policy + beta * kl, "policy_loss": policy, "kl": kl,
            "old_deviate": jnp.mean(terms["old_deviate"]), "old_deviate_max": jnp.max(terms["old_deviate"])}


def _loss(lora, old, frozen, step, scale, *, graphdef, config, objective):
    xt = noised(step["final_latents"], step["noise"], step["t"])

    def velocity(params, lora_scale=1.0):
        model = objective.velocity(nnx.merge(graphdef, params, frozen), step)
        return model(xt, step["t"], step["prompt_embeds"], step["prompt_mask"], grid_hw=config.grid_hw,
                     lora_scale=lora_scale)

    v_ref = velocity(lora, 0.0) if config.beta > 0 else None
    terms = loss_terms(velocity(lora), velocity(old), step["final_latents"], xt, step["t"], step["advantages"],
                       nft_beta=config.nft_beta, adv_clip=config.adv_clip, v_ref=v_ref)
    return (jnp.mean(terms["policy"]) + config.beta * jnp.mean(terms["kl"])) * scale, terms


def gradients(graphdef, lora, old, frozen, batch: dict, key, config, layout=None, *, objective):
    """DiffusionNFT's counterpart of `flowgrpo_step.accumulate_gradients` (`config` a TrainConfig, `layout` a Layout or
    None): the sum over micro-batches and noised timesteps of grad(loss / (M * T)) wrt `lora` (M = num_micro_batches,
    T = nft_timesteps) and the per-sample terms stacked as (M, T, B/M). Each sample trains on T distinct timesteps of
    its schedule with fresh noise, both drawn from `key` (`timestep_picks`); `old` is the old policy's LoRA (no
    gradient); `objective` (the family's) conditions the model on the micro-batch's `CONDITION_FIELDS`."""
    def loss(params, step, scale):
        return _loss(params, old, frozen, step, scale, graphdef=graphdef, config=config, objective=objective)

    return forward_process.timestep_gradients(
        loss, lora, batch, key, num_micro_batches=config.num_micro_batches, count=config.nft_timesteps,
        pick=timestep_picks, fields=("final_latents", "advantages", "prompt_embeds", "prompt_mask", *CONDITION_FIELDS),
        layout=layout)


def advanced(old, lora, updates, decay: tuple[float, float, float]):
    """The old policy after a step: d old + (1 - d) lora, d = `old_decay(updates, *decay)` (updates so far)."""
    d = old_decay(updates, *decay)
    return jax.tree.map(lambda o, p: d * o + (1 - d) * p, old, lora)


@dataclasses.dataclass(frozen=True)
class DiffusionNFT(forward_process.ForwardProcessLoss):
    """DiffusionNFT on the rollout's final latents, nft_timesteps noised timesteps a sample; the old policy
    (TrainState.old, what the rollout serves) moved after each step by `old_decay(*nft_decay)`."""

    keeps_old: bool = True

    def batch_fields(self, config) -> tuple[str, ...]:
        return self.fields

    def update(self, state, frozen, mb: dict, old, index, *, graphdef, config, layout, objective):
        """(grads, metrics, None)."""
        key = self.update_key(config, state.step)
        grads, terms = gradients(graphdef, state.lora, state.old, frozen, mb, key, config, layout, objective=objective)
        return grads, step_metrics(terms, config.beta), None

    def passes(self, config, window: int) -> tuple[int, int]:
        """Each noised timestep's velocity trained (no CFG), the old policy's beside it, with a KL the
        adapters-off one too."""
        return config.nft_timesteps, config.nft_timesteps * (2 if config.beta > 0 else 1)

    def advanced(self, old, lora, updates, config):
        return advanced(old, lora, updates, config.nft_decay)

    def rules(self, config, policy):
        flat, rate, cap = config.nft_decay
        return (
            ("guidance", config.guidance != 1, "NFT trains and samples a CFG-free policy: 1"),
            ("sde_type", config.sde_type not in ("sde", "cps", "ode"),
             "choose 'ode' (DiffusionNFT's deterministic rollout), 'sde' or 'cps'"),
            ("old_log_prob", policy.old_log_prob.rejection(config) is not None,
             "corrects log-probs; NFT has none: 'rollout'"),
            ("ratio_norm", policy.ratio.name != "none", "is a FlowGRPO ratio; NFT has none: 'none'"),
            ("drop_zero_advantage", policy.filter.compacts, "a zero advantage still trains in NFT (r = 1/2): False"),
            ("nft_beta", not config.nft_beta > 0, "must be > 0"),
            ("nft_timesteps", config.nft_timesteps < 1, "must be >= 1"),
            ("nft_decay", not (flat >= 0 and rate >= 0 and 0 <= cap < 1),
             "(flat updates, rate, cap): flat >= 0, rate >= 0, cap in [0, 1)"))


NFT = DiffusionNFT("nft", "DiffusionNFT on the forward process", fields=FIELDS, salt=SALT,
                   config_keys=("algorithm", "nft_beta", "nft_timesteps", "nft_decay", "adv_clip", "beta",
                                "shuffle_seed", "num_micro_batches"))
