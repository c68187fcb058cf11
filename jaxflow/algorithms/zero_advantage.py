"""The row filter (train.drop_zero_advantage), flow_grpo's SD3 trainer's (`scripts/train_sd3.py`: it drops the
samples whose advantages are all 0 and re-batches the others): every row trains (False), or the rows with advantage
0 are dropped (True) and each update's loss is the mean over the rows it kept. Shapes stay static under jit: the
driver deals the kept rows into each mini-batch's first micro-batches (`minibatches.compact_zero_advantage`,
`RowLayout.packed`), the micro-batches left with no kept row are not run, and a row's loss weight is 1 / (K W)
where it is kept (K the update's kept rows, W the window steps), 0 where not (a partly-filled micro-batch's zero
rows)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxflow.algorithms.base import Component


def _zeros(shapes):
    return jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), shapes)


@dataclasses.dataclass(frozen=True)
class KeepAll(Component):
    """Every row trains, each weighing 1 / (B' W) (B' the mini-batch's rows): the mean over all of them."""

    compacts: bool = False

    def active(self, advantages):
        return jnp.ones(advantages.shape[0], bool)

    def weights(self, advantages, w: int):
        return jnp.full(advantages.shape, 1.0 / (advantages.size * w), jnp.float32)

    def run(self, train, grads, run):
        return train(grads)

    def marked(self, terms: dict, advantages) -> dict:
        return terms

    def runs(self, terms: dict, metrics: dict):
        return None

    def forward(self, forward, mb: dict):
        return forward()

    def logp_rows(self, diff, advantages):
        return diff


@dataclasses.dataclass(frozen=True)
class DropZero(KeepAll):
    """A row whose advantage is 0 weighs 0 and the others 1 / (K W), K the update's kept rows; a micro-batch with no
    kept row is not run. The terms then carry `mask` (M, W, B/M): the kept rows (the metrics are theirs); an update
    with no kept row is no optimizer update (flow_grpo's trainer would have an empty batch)."""

    compacts: bool = True

    def active(self, advantages):
        return jnp.any(advantages != 0, axis=1)

    def weights(self, advantages, w: int):
        keep = advantages != 0
        return keep.astype(jnp.float32) / (jnp.maximum(jnp.sum(keep), 1) * w).astype(jnp.float32)

    def run(self, train, grads, run):
        shapes = jax.eval_shape(train, grads)[1]
        return jax.lax.cond(run, train, lambda g: (g, _zeros(shapes)), grads)

    def marked(self, terms: dict, advantages) -> dict:
        terms["mask"] = jnp.broadcast_to((advantages != 0)[:, None, :], terms["ratio"].shape)
        return terms

    def runs(self, terms: dict, metrics: dict):
        """Which micro-batches ran; metrics gain rows_dropped, micro_skipped and empty_updates."""
        runs = jnp.any(terms["mask"], axis=(1, 2))
        metrics.update(rows_dropped=jnp.sum(~terms["mask"][:, 0]).astype(jnp.int32),
                       micro_skipped=jnp.sum(~runs).astype(jnp.int32),
                       empty_updates=(~jnp.any(runs)).astype(jnp.int32))
        return runs

    def forward(self, forward, mb: dict):
        """The recompute pass: a micro-batch the updates skip (advantages all 0) needs no logp_old."""
        return jax.lax.cond(jnp.any(mb["advantages"] != 0), forward, lambda: _zeros(jax.eval_shape(forward)))

    def logp_rows(self, diff, advantages):
        """Dropped rows have no logp_old (their micro-batch may not have run)."""
        return jnp.where(advantages[:, None] != 0, diff, 0.0)


KEEP_ALL = KeepAll("none", "every row trains", config_keys=("drop_zero_advantage",))
DROP_ZERO = DropZero("zero_advantage", "rows whose advantage is 0 are dropped, the loss is the kept rows' mean",
                     fields=("advantages",), config_keys=("drop_zero_advantage",))
