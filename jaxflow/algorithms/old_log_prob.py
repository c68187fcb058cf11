"""The source of logp_old (train.old_log_prob): the rollout's log-probs ("rollout") or the trainer's recompute pass
("recompute": `old_log_probs`, one forward-only pass with the pre-update LoRA before the first update, as verl-omni's
`compute_log_prob` does); rollout correction ("rollout_corrected") is `rollout_correction`."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxflow.trainer import minibatches
from jaxflow.algorithms import flowgrpo
from jaxflow.algorithms.base import Component
from jaxflow.algorithms.objective import WINDOW, Objective
from jaxflow.trainer.sharding import Layout


@dataclasses.dataclass(frozen=True)
class Source(Component):
    """from_rollout: logp_old is the rollout's log_probs (else the recompute pass's, or the on-policy logp);
    every_row: the recompute pass must score every row, whatever the updates (its logp_old weighs them: `weigh`)."""

    from_rollout: bool = True
    every_row: bool = False

    def with_old(self, batch: dict) -> dict:
        return {**batch, "old_log_probs": batch["log_probs"]} if self.from_rollout else batch

    def rejection(self, config):
        return None

    def weigh(self, batch: dict, config) -> dict:
        """The per-sample batch with rollout correction's (B, W) weights "rc_weights" and "rc_keep" where the source
        weighs window steps before the update (`rollout_correction.Decoupled`); else as given."""
        return batch


ROLLOUT = Source("rollout", "the engine's log-probs", fields=("log_probs",), config_keys=("old_log_prob",))
RECOMPUTE = Source("recompute", "the trainer's, before the first update", fields=("log_probs",),
                   config_keys=("old_log_prob", "off_policy"), recompute=True, from_rollout=False)


def old_log_probs(graphdef, lora, frozen, batch: dict, config, layout: Layout | None = None,
                  objective: Objective = WINDOW) -> dict:
    """{"log_probs": (B, W) float32 log-probs of the stored window steps under `lora`} and, where the ratio needs them
    (ratio_norm="guard"), "means": (B, W, S, C) the SDE steps' means; forward only (true CFG as in training), in the
    updates' micro-batches: num_mini_batches x num_micro_batches of them, each the same rows in the same order as one
    micro-batch of an update (a micro-batch the filter skips gets zeros); `objective` as in
    `flowgrpo_step.accumulate_gradients`."""
    policy = config.policy
    m, k = config.num_mini_batches, config.num_mini_batches * config.num_micro_batches
    # whole-batch micro-batch c holds mini-batch c % m's micro-batch c // m; mini-batch 0's are left out when the
    # first update uses its own logp (`pass_skips_first`)
    run = [c for c in range(k) if c % m or not config.pass_skips_first]

    def micro(carry, mb):
        if layout is not None:
            mb = jax.lax.with_sharding_constraint(mb, layout.batch_sharding)
        per_step, shared = flowgrpo.window_steps(mb)

        def forward():
            ctx = objective.context(nnx.merge(graphdef, lora, frozen), shared, config)

            def window(carry, xs):
                model = nnx.merge(graphdef, lora, frozen)
                mean, logp, _ = objective.log_prob(model, {**ctx, **xs}, config)
                out = {"log_probs": logp.astype(jnp.float32)}
                if policy.ratio.old_means:
                    out["means"] = mean.astype(jnp.float32)
                return carry, out

            return jax.lax.scan(window, carry, per_step)[1]

        return carry, policy.filter.forward(forward, mb)

    rows = minibatches.RowLayout(m, config.num_micro_batches)
    mbs = jax.tree.map(lambda x: x[np.asarray(run)], rows.all_micro_batches(batch))
    parts = jax.lax.scan(micro, None, mbs)[1]  # each (len(run), W, B/k, ...)

    def whole(part):  # the (k, W, B/k, ...) stack back in batch rows
        return rows.unstack(jnp.zeros((k, *part.shape[1:]), part.dtype).at[np.asarray(run)].set(part), axis=2)

    return jax.tree.map(whole, parts)
