"""FlowGRPO's policy loss (train.algorithm="flowgrpo") over one mini-batch: `accumulate_gradients` sums, over
micro-batches and window steps, the gradient of `flowgrpo.window_step_terms`' loss; `FLOWGRPO` is its registered
component, whose `update` the train step calls (`jaxflow.trainer.train_step`)."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxflow.trainer import minibatches
from jaxflow.algorithms import flowgrpo
from jaxflow.algorithms.base import Component
from jaxflow.algorithms.objective import WINDOW, Objective
from jaxflow.trainer.sharding import Layout
from jaxflow_bridge.contract.batch import GUIDANCE_FIELDS

FIELDS = ("latents", "log_probs", "sigmas", "step_index", "noise_level", "prompt_embeds", "prompt_mask", "advantages")


def _window_loss(lora, frozen, step, weight, *, graphdef, config, objective: Objective):
    model = nnx.merge(graphdef, lora, frozen)
    terms = flowgrpo.window_step_terms(
        model, step, grid_hw=config.grid_hw, sde_type=config.sde_type, guidance=config.guidance,
        clip_range=config.policy.ratio.clip_range(config), adv_clip=config.adv_clip, beta=config.beta,
        reject=config.policy.old_log_prob.rejection(config), ratio_norm=config.ratio_norm,
        guard_stats=config.guard_stats,
        log_prob=functools.partial(objective.log_prob, config=config))
    return flowgrpo.window_loss(terms, config.beta, weight), terms


def accumulate_gradients(graphdef, lora, frozen, batch: dict, config, layout: Layout | None = None,
                         objective: Objective = WINDOW):
    """Sum over micro-batches and window steps of the gradient of the rows' weighted loss wrt `lora` (weights by the
    filter: 1 / (B' W) each, the mini-batch's mean as flow_grpo divides by its accumulation steps), and the
    per-sample terms stacked as (M, W, B/M), M = num_micro_batches (`config` a TrainConfig). `batch` is per-sample (see
    `train_step.prepare_batch`). logp_old: the rollout's log_probs where the source is the rollout's
    (old_log_prob="rollout", or "rollout_corrected", which also rejects: `rollout_correction`), else
    batch["old_log_probs"] (B, W) if given, else the on-policy stop_gradient(logp).

    The filter (`zero_advantage`) picks the micro-batches that run and the rows' weights: with
    drop_zero_advantage the loss is the mean over the rows whose advantage is not 0 (the terms carry their `mask`).
    `objective` (`jaxflow.algorithms.objective`): the model family's window log-prob; its `context` runs once per
    micro-batch, outside the gradient (e.g. a family's frozen text contexts' K/V, reused at every window step)."""
    policy = config.policy
    m, w = config.num_micro_batches, batch["log_probs"].shape[1]
    batch = policy.old_log_prob.weigh(policy.old_log_prob.with_old(batch), config)
    flags = {k: batch[k] for k in ("old_on_policy",) if k in batch}  # scalars, not per sample
    batch = minibatches.micro_batches({k: v for k, v in batch.items() if k not in flags}, m)
    active = policy.filter.active(batch["advantages"])
    weights = policy.filter.weights(batch["advantages"], w)
    grad_fn = jax.grad(functools.partial(_window_loss, graphdef=graphdef, config=config, objective=objective),
                       has_aux=True)

    def micro(grads, xs):
        mb, run, weight = xs
        if layout is not None:
            mb = jax.lax.with_sharding_constraint(mb, layout.batch_sharding)
        per_step, shared = flowgrpo.window_steps(mb)

        def train(grads):
            ctx = objective.context(nnx.merge(graphdef, lora, frozen), shared, config)

            def window(grads, xs):
                g, terms = grad_fn(lora, frozen, {**ctx, **flags, **xs}, weight=weight)
                return jax.tree.map(jnp.add, grads, g), terms

            return jax.lax.scan(window, grads, per_step)

        return policy.filter.run(train, grads, run)

    grads, terms = jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, lora), (batch, active, weights))
    return grads, policy.filter.marked(terms, batch["advantages"])


@dataclasses.dataclass(frozen=True)
class FlowGRPO(Component):
    """FlowGRPO: PPO's clipped objective on the SDE window steps' log-probs (+ beta KL)."""

    log_probs: bool = True
    keeps_old: bool = False

    def batch_fields(self, config) -> tuple[str, ...]:
        return self.fields + (GUIDANCE_FIELDS if config.guided else ())

    def missing_hint(self, missing: list[str]) -> str:
        return ""

    def prepare(self, out: dict, batch, config) -> dict:
        """`out` checked against the window's shapes, its SDE fields in the step's dtypes."""
        b, w = len(batch), batch.log_probs.shape[1]
        latents, step_index = batch.latents.shape, batch.step_index.shape
        if latents[:2] != (b, w + 1) or step_index != (b, w):
            raise ValueError(f"latents {latents} / step_index {step_index} do not match log_probs {(b, w)}: "
                             f"expected (B, W+1, S, C) / (B, W)")
        out["noise_level"] = out["noise_level"].astype(np.float32)
        out["step_index"] = out["step_index"].astype(np.int32)
        return out

    def update(self, state, frozen, mb: dict, old, index, *, graphdef, config, layout, objective):
        """(grads, metrics, runs) of one update on mini-batch `mb` (number `index`); `old` the recompute pass's
        output for it or None; runs: which micro-batches ran (None: all). metrics["logp_gap"] (M, W, B/M) holds
        |logp - logp_rollout| per sample and window step, NaN where the filter left a row out (the train step reads
        the first update's for the log-prob gate, `jaxflow.trainer.logp_gate`)."""
        if old is not None:
            old = minibatches.select(old, config.num_mini_batches, index)
            mb["old_log_probs"] = old["log_probs"]
            if "means" in old:
                mb["old_means"] = old["means"]
            if config.pass_skips_first:  # the pass left mini-batch 0 out: the first update is on-policy
                mb["old_on_policy"] = index == 0
        grads, terms = accumulate_gradients(graphdef, state.lora, frozen, mb, config, layout, objective)
        metrics = flowgrpo.step_metrics(terms, clip_range=config.policy.ratio.clip_range(config), beta=config.beta)
        gap = jnp.abs(terms["dlogp"])
        metrics["logp_gap"] = gap if "mask" not in terms else jnp.where(terms["mask"], gap, jnp.nan)
        return grads, metrics, config.policy.filter.runs(terms, metrics)

    def passes(self, config, window: int) -> tuple[int, int]:
        """Each window step's guided velocity (two passes with true CFG) trained; with a KL the adapters-off one
        beside it."""
        guided = window * (2 if config.guided else 1)
        return guided, guided if config.beta > 0 else 0

    def rules(self, config, policy):
        return (("sde_type", config.sde_type not in ("sde", "cps"),
                 "training needs 'sde' or 'cps' ('ode' has no log-prob to train; it samples for algorithm 'nft')"),)


FLOWGRPO = FlowGRPO("flowgrpo", "FlowGRPO's clipped objective on the SDE log-probs", fields=FIELDS,
                    config_keys=("algorithm", "sde_type", "guidance", "clip_range", "adv_clip", "beta",
                                 "num_micro_batches"))
