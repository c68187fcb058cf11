"""PPO mini-batches: one step's batch in M mini-batches of whole prompt groups, one optimizer update each.

The row layout the train step reads is `RowLayout` (mini-batch j = rows j, j + M, ...; micro-batch k of it = its
rows k, k + m, ...), the only place its strides are written. `order_minibatches` (host side, before the batch is put or broadcast) shuffles
the prompt groups, seeded by (seed, step) so a resumed run repeats it, and lays them out so that each mini-batch
holds whole groups; `compact_zero_advantage` (train.drop_zero_advantage) then moves, inside each mini-batch, the rows
whose advantage is not zero into its first micro-batches, so the step can skip the micro-batches left with none
(the dropped rows of a partly-filled one weigh 0: `jaxflow.algorithms.zero_advantage`).
`combine_metrics` reduces the per-update metrics to the step's and names the per-position
ones.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow.trainer.train_batch import TrainBatch

POSITION_KEYS = ("ratio_min", "ratio_mean", "ratio_max", "clipfrac", "approx_kl")


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Which rows of a step's batch form micro-batch k of mini-batch j, the one statement of the strides that the
    host (`group_order`, `packed`) and the devices (`select`, `micro_batches`, `unstack`) read.

    Mini-batch j of the batch is rows j, j + M, j + 2M, ... (M = `mini`), micro-batch k of a mini-batch its rows k,
    k + m, ... (m = `micro`): row r of micro-batch k of mini-batch j is batch row (k + r m) M + j. With the batch
    sharded over the data devices every micro-batch is spread evenly over all of them and taking one is local to
    each device; process p holds the contiguous rows `process_rows(p)`."""

    mini: int = 1
    micro: int = 1

    def check(self, batch: int) -> None:
        """ValueError unless a batch of `batch` rows splits into the layout's mini- and micro-batches."""
        if batch % (self.mini * self.micro):
            raise ValueError(f"batch {batch} is not a multiple of num_mini_batches x num_micro_batches = "
                             f"{self.mini * self.micro}")

    def rows(self, batch: int, j: int, k: int | None = None) -> np.ndarray:
        """Host: the batch rows of mini-batch j (k None) or of its micro-batch k, in the order the step reads them."""
        self.check(batch)
        mini = np.arange(j, batch, self.mini)
        return mini if k is None else mini[k::self.micro]

    def process_rows(self, batch: int, process: int, processes: int) -> slice:
        """Host: process `process`'s contiguous share of the batch's rows (the global batch is their concatenation)."""
        share = batch // processes
        return slice(process * share, (process + 1) * share)

    def packed(self, keep, xp=np):
        """(B,) row indices: each mini-batch's own rows, those where `keep` (B,) is True dealt so that they fill its
        micro-batch 0, then 1, ... (in their order), the others after them. `xp`: numpy on the host, jax.numpy on the
        devices."""
        b, mini, micro = keep.shape[0], self.mini, self.micro
        per_mini = b // mini
        i = np.arange(per_mini)
        slot = (i % (per_mini // micro)) * micro + i // (per_mini // micro)  # the i-th kept row's place in the mini
        stable = {"kind": "stable"} if xp is np else {"stable": True}  # numpy < 2 has no stable=
        ranked = xp.argsort(~keep.reshape(per_mini, mini), axis=0, **stable)  # column j: mini-batch j's positions
        placed = ranked[np.argsort(slot)]  # placed[slot[i]] = ranked[i]
        return (placed * mini + np.arange(mini)[None]).reshape(b)  # position r of mini-batch j is row r * M + j

    def select(self, tree, j):
        """Device: mini-batch j (a traced int32 is fine) of a per-sample tree (B/M, ...)."""
        if self.mini == 1:
            return tree
        return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(_strided(x, self.mini), j, axis=1,
                                                                   keepdims=False), tree)

    def micro_batches(self, tree):
        """Device: a mini-batch's (B', ...) arrays as its micro-batches, (m, B'/m, ...)."""
        return jax.tree.map(lambda x: jnp.swapaxes(_strided(x, self.micro), 0, 1), tree)

    def all_micro_batches(self, tree):
        """Device: the whole batch as its M x m micro-batches (M m, B/(M m), ...), number c = micro-batch c // M of
        mini-batch c % M."""
        return RowLayout(1, self.mini * self.micro).micro_batches(tree)

    def unstack(self, stacked, axis: int = 1):
        """Inverse of `all_micro_batches` for an output stacked (M m, ..., B/(M m), ...) with its rows on `axis`:
        the (B, ...) batch rows, in batch order (row t M m + c is [c, ..., t, ...])."""
        xp = np if isinstance(stacked, np.ndarray) else jnp  # the host's float64 stays float64
        moved = xp.moveaxis(stacked, axis, 0)  # (B/(M m), M m, ...)
        return moved.reshape(-1, *moved.shape[2:])


def _strided(x, n: int):
    """(B, ...) -> (B/n, n, ...): [r, i] is row r n + i, so [:, i] is the strided part i (rows i, i + n, ...)."""
    return x.reshape(x.shape[0] // n, n, *x.shape[1:])


def group_order(group_ids, num_mini_batches: int, seed: int, step: int) -> np.ndarray:
    """(B,) row indices: the batch in the step's layout (`RowLayout`), each mini-batch a set of whole groups
    (shuffled by (seed, step)). M = 1 keeps the batch as it is."""
    group_ids = np.asarray(group_ids)
    b, m = len(group_ids), num_mini_batches
    if m == 1:
        return np.arange(b)
    groups, counts = np.unique(group_ids, return_counts=True)
    if len(groups) % m or np.any(counts != counts[0]):
        raise ValueError(f"{len(groups)} groups of sizes {sorted(set(counts.tolist()))}: num_mini_batches {m} "
                         f"needs equal groups, a multiple of {m} of them")
    shuffled = np.random.default_rng([seed, step, 0x6d62]).permutation(groups)
    order = np.empty(b, np.int64)
    layout = RowLayout(m)
    for j, part in enumerate(np.split(shuffled, m)):
        order[layout.rows(b, j)] = np.concatenate([np.flatnonzero(group_ids == g) for g in part])
    return order


def order_minibatches(batch: TrainBatch, group_ids, num_mini_batches: int, seed: int, step: int) -> TrainBatch:
    """`batch` (group g in any rows) with its rows reordered by `group_order` (`TrainBatch.reordered`: the shared
    sigmas and noise_level kept as they are)."""
    if num_mini_batches == 1:
        return batch
    return batch.reordered(group_order(group_ids, num_mini_batches, seed, step))


def zero_advantage_order(advantages, num_mini_batches: int, num_micro_batches: int) -> np.ndarray:
    """(B,) row indices: each mini-batch's own rows, those with a non-zero advantage dealt into its first
    micro-batches (`RowLayout.packed`); the rows with advantage 0 fill the rest."""
    adv = np.asarray(advantages)
    layout = RowLayout(num_mini_batches, num_micro_batches)
    layout.check(len(adv))
    return layout.packed(adv != 0)


def epoch_order(key, advantages, num_mini_batches: int, num_micro_batches: int, compact: bool) -> jax.Array:
    """(B,) row indices for a later inner epoch, on the device: every row shuffled by `key` (flow_grpo permutes the
    samples between inner epochs, so prompt groups no longer stay whole), then with `compact` the
    `zero_advantage_order` of the shuffled rows."""
    perm = jax.random.permutation(key, advantages.shape[0])
    if not compact:
        return perm
    return perm[RowLayout(num_mini_batches, num_micro_batches).packed(advantages[perm] != 0, jnp)]


def compact_zero_advantage(batch: TrainBatch, num_mini_batches: int, num_micro_batches: int) -> TrainBatch:
    """`batch` (mini-batches laid out) with its rows reordered by `zero_advantage_order`."""
    return batch.reordered(zero_advantage_order(batch.advantages, num_mini_batches, num_micro_batches))


def micro_batches(batch: dict, m: int) -> dict:
    """(B, ...) -> (m, B/m, ...), the m micro-batches of a mini-batch (`RowLayout.micro_batches`)."""
    return RowLayout(1, m).micro_batches(batch)


def select(tree, m: int, j) -> dict:
    """Mini-batch j (a traced int32 is fine) of M = m (`RowLayout.select`)."""
    return RowLayout(m).select(tree, j)


SUMMED = ("skipped", "rows_dropped", "micro_skipped", "empty_updates")


def combine_metrics(updates: list[dict]) -> dict:
    """The step's metrics from its updates' (equal-sized mini-batches): min of *_min, max of *_max and
    logp_diff_max, sum of SUMMED, mean of the rest; where the updates report empty_updates (drop_zero_advantage),
    zero_advantage_step = 1 when none of them had a row to train (every advantage 0: the step made no update). With
    more than one update, also `mb{k}/<key>` for the k-th update of the step (k = 1 .. num_inner_epochs x
    num_mini_batches) and each key of POSITION_KEYS the updates report (DiffusionNFT's have no ratio)."""
    if len(updates) == 1:
        out = dict(updates[0])
    else:
        out = {key: _reduced(key, jnp.stack([u[key] for u in updates])) for key in updates[0]}
        for k, u in enumerate(updates, 1):
            out.update({f"mb{k}/{key}": u[key] for key in POSITION_KEYS if key in u})
    if "empty_updates" in out:
        out["zero_advantage_step"] = (out["empty_updates"] == len(updates)).astype(jnp.int32)
    return out


def _reduced(key: str, stacked):
    if key.endswith("_min"):
        return jnp.min(stacked, axis=0)
    if key.endswith("_max"):
        return jnp.max(stacked, axis=0)
    if key in SUMMED:
        return jnp.sum(stacked, axis=0)
    return jnp.mean(stacked, axis=0)
