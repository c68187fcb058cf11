"""PPO mini-batches: one step's batch in M mini-batches of whole prompt groups, one optimizer update each.

Layout the train step reads: mini-batch j holds rows j, j + M, j + 2M, ... of its batch. With the batch sharded
over the data devices every mini-batch is spread evenly over all of them, and taking one is a slice local to
each device (no communication). `order_minibatches` (host side, before the batch is put or broadcast) shuffles
the prompt groups, seeded by (seed, step) so a resumed run repeats it, and lays them out so that each mini-batch
holds whole groups; `compact_zero_advantage` (train.drop_zero_advantage) then moves, inside each mini-batch, the rows
whose advantage is not zero into its first micro-batches, so the step can skip the micro-batches left with none.
`combine_metrics` reduces the per-update metrics to the step's and names the per-position
ones.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow.trainer.train_batch import TrainBatch

POSITION_KEYS = ("ratio_min", "ratio_mean", "ratio_max", "clipfrac", "approx_kl")


def group_order(group_ids, num_mini_batches: int, seed: int, step: int) -> np.ndarray:
    """(B,) row indices: the batch in the step's layout, mini-batch j = rows order[j::M], each a set of whole
    groups (shuffled by (seed, step)). M = 1 keeps the batch as it is."""
    group_ids = np.asarray(group_ids)
    b, m = len(group_ids), num_mini_batches
    if m == 1:
        return np.arange(b)
    groups, counts = np.unique(group_ids, return_counts=True)
    if len(groups) % m or np.any(counts != counts[0]):
        raise ValueError(f"{len(groups)} groups of sizes {sorted(set(counts.tolist()))}: num_mini_batches {m} "
                         f"needs equal groups, a multiple of {m} of them")
    shuffled = np.random.default_rng([seed, step, 0x6d62]).permutation(groups)
    rows = [np.concatenate([np.flatnonzero(group_ids == g) for g in part]) for part in np.split(shuffled, m)]
    return np.stack(rows, axis=1).reshape(b)  # position r * M + j = row r of mini-batch j


def order_minibatches(batch: TrainBatch, group_ids, num_mini_batches: int, seed: int, step: int) -> TrainBatch:
    """`batch` (group g in any rows) with its rows reordered by `group_order` (`TrainBatch.reordered`: the shared
    sigmas and noise_level kept as they are)."""
    if num_mini_batches == 1:
        return batch
    return batch.reordered(group_order(group_ids, num_mini_batches, seed, step))


def _compacted(zero, num_mini_batches: int, num_micro_batches: int, xp):
    """(B,) row indices of the laid-out rows whose advantage-is-zero flags are `zero` (B,): each mini-batch's own rows
    (j, j + M, ...), the non-zero ones first (in their order), dealt so that they fill micro-batch 0, then 1, ...
    (micro-batch k of a mini-batch = its rows k, k + m, ...). `xp`: numpy on the host, jax.numpy on the devices."""
    b, mini, micro = zero.shape[0], num_mini_batches, num_micro_batches
    per_mini = b // mini
    i = np.arange(per_mini)
    slot = (i % (per_mini // micro)) * micro + i // (per_mini // micro)  # the i-th kept row's place in the mini-batch
    stable = {"kind": "stable"} if xp is np else {"stable": True}  # numpy < 2 has no stable=
    ranked = xp.argsort(zero.reshape(per_mini, mini), axis=0, **stable)  # column j: mini-batch j's positions
    placed = ranked[np.argsort(slot)]  # placed[slot[i]] = ranked[i]
    return (placed * mini + np.arange(mini)[None]).reshape(b)  # position r of mini-batch j is row r * M + j


def zero_advantage_order(advantages, num_mini_batches: int, num_micro_batches: int) -> np.ndarray:
    """(B,) row indices: each mini-batch's own rows, those with a non-zero advantage dealt into its first
    micro-batches (`_compacted`); the rows with advantage 0 fill the rest."""
    adv = np.asarray(advantages)
    if len(adv) % (num_mini_batches * num_micro_batches):
        raise ValueError(f"batch {len(adv)} is not a multiple of num_mini_batches x num_micro_batches = "
                         f"{num_mini_batches * num_micro_batches}")
    return _compacted(adv == 0, num_mini_batches, num_micro_batches, np)


def epoch_order(key, advantages, num_mini_batches: int, num_micro_batches: int, compact: bool) -> jax.Array:
    """(B,) row indices for a later inner epoch, on the device: every row shuffled by `key` (flow_grpo permutes the
    samples between inner epochs, so prompt groups no longer stay whole), then with `compact` the
    `zero_advantage_order` of the shuffled rows."""
    perm = jax.random.permutation(key, advantages.shape[0])
    if not compact:
        return perm
    return perm[_compacted(advantages[perm] == 0, num_mini_batches, num_micro_batches, jnp)]


def compact_zero_advantage(batch: TrainBatch, num_mini_batches: int, num_micro_batches: int) -> TrainBatch:
    """`batch` (mini-batches laid out) with its rows reordered by `zero_advantage_order`."""
    return batch.reordered(zero_advantage_order(batch.advantages, num_mini_batches, num_micro_batches))


def micro_batches(batch: dict, m: int) -> dict:
    """(B, ...) -> (m, B/m, ...), micro-batch k = rows k, k + m, ... (of a mini-batch, on the devices)."""
    return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1), batch)


def select(tree, m: int, j) -> dict:
    """Mini-batch j (a traced int32 is fine) of a per-sample tree: rows j, j + m, ... (B/m, ...)."""
    if m == 1:
        return tree
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x.reshape(x.shape[0] // m, m, *x.shape[1:]), j,
                                                               axis=1, keepdims=False), tree)


def combine_metrics(updates: list[dict]) -> dict:
    """The step's metrics from its updates' (equal-sized mini-batches): min of *_min, max of *_max and
    logp_diff_max, sum of skipped, micro_skipped and empty_updates, mean of the rest. With more than one update,
    also `mb{k}/<key>` for the k-th update of the step (k = 1 .. num_inner_epochs x num_mini_batches) and each key of
    POSITION_KEYS the updates report (DiffusionNFT's have no ratio)."""
    if len(updates) == 1:
        return updates[0]
    out = {}
    for key in updates[0]:
        stacked = jnp.stack([u[key] for u in updates])
        if key.endswith("_min"):
            out[key] = jnp.min(stacked, axis=0)
        elif key.endswith("_max"):
            out[key] = jnp.max(stacked, axis=0)
        elif key in ("skipped", "micro_skipped", "empty_updates"):
            out[key] = jnp.sum(stacked, axis=0)
        else:
            out[key] = jnp.mean(stacked, axis=0)
    for k, u in enumerate(updates, 1):
        out.update({f"mb{k}/{key}": u[key] for key in POSITION_KEYS if key in u})
    return out
