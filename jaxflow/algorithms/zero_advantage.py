"""The micro-batch filter (train.drop_zero_advantage): every micro-batch trains (False), or one whose advantages are
all 0 is not run (True: its rows' policy gradient is 0 and, with beta = 0, so is their loss), as flow_grpo's SD3
trainer trains only the samples it keeps. The driver first gathers the zero rows into whole micro-batches
(`minibatches.compact_zero_advantage`)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxflow.algorithms.base import Component


def _zeros(shapes):
    return jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), shapes)


@dataclasses.dataclass(frozen=True)
class KeepAll(Component):
    """Every micro-batch trains; the loss is divided by (M * W)."""

    compacts: bool = False

    def active(self, advantages, m: int):
        return jnp.ones(m, bool)

    def scale(self, active, m: int, w: int):
        return 1.0 / (m * w)

    def run(self, train, grads, run):
        return train(grads)

    def marked(self, terms: dict, active) -> dict:
        return terms

    def runs(self, terms: dict, metrics: dict):
        return None

    def forward(self, forward, mb: dict):
        return forward()

    def logp_rows(self, diff, advantages):
        return diff


@dataclasses.dataclass(frozen=True)
class DropZero(KeepAll):
    """A micro-batch whose advantages are all 0 is not run and M counts the others only, so the loss is the mean over
    the micro-batches that train. The terms then carry `mask` (M, W, B/M): False where a micro-batch did not run
    (its terms are zeros); an update with none to train on is no optimizer update (flow_grpo would have no batch)."""

    compacts: bool = True

    def active(self, advantages, m: int):
        return jnp.any(advantages != 0, axis=1)

    def scale(self, active, m: int, w: int):
        return 1.0 / (jnp.maximum(jnp.sum(active), 1) * w)

    def run(self, train, grads, run):
        shapes = jax.eval_shape(train, grads)[1]
        return jax.lax.cond(run, train, lambda g: (g, _zeros(shapes)), grads)

    def marked(self, terms: dict, active) -> dict:
        terms["mask"] = jnp.broadcast_to(active[:, None, None], terms["ratio"].shape)
        return terms

    def runs(self, terms: dict, metrics: dict):
        """Which micro-batches ran (metrics gain micro_skipped and empty_updates)."""
        runs = jnp.any(terms["mask"], axis=(1, 2))
        metrics.update(micro_skipped=jnp.sum(~runs).astype(jnp.int32),
                       empty_updates=(~jnp.any(runs)).astype(jnp.int32))
        return runs

    def forward(self, forward, mb: dict):
        """The recompute pass: a micro-batch the updates skip (advantages all 0) needs no logp_old."""
        return jax.lax.cond(jnp.any(mb["advantages"] != 0), forward, lambda: _zeros(jax.eval_shape(forward)))

    def logp_rows(self, diff, advantages):
        """Rows of skipped micro-batches have no logp_old."""
        return jnp.where(advantages[:, None] != 0, diff, 0.0)


KEEP_ALL = KeepAll("none", "every micro-batch trains", config_keys=("drop_zero_advantage",))
DROP_ZERO = DropZero("zero_advantage", "micro-batches whose advantages are all 0 are not trained",
                     fields=("advantages",), config_keys=("drop_zero_advantage",))
