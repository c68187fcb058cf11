"""train.drop_zero_advantage: rows of equal-reward groups gathered into whole micro-batches that the
step skips; the update equals training on the other rows alone; nothing trains when every advantage is 0."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxflow.trainer import train_step as ts
from jaxflow.trainer.minibatches import compact_zero_advantage, order_minibatches, select, zero_advantage_order
from jaxflow.trainer.train_batch import TrainBatch
from tests.helpers import GRID, GROUPS, sampled_batch


def test_order_fills_leading_micro_batches_within_each_mini_batch():
    rng = np.random.default_rng(0)
    adv = np.where(rng.random(48) < 0.6, 0.0, rng.normal(size=48))
    for mini, micro in ((1, 4), (2, 3), (3, 2)):
        order = zero_advantage_order(adv, mini, micro)
        assert sorted(order) == list(range(48))
        for j in range(mini):
            rows = np.asarray(select(order, mini, j))
            assert set(rows) == set(range(j, 48, mini))  # a mini-batch keeps its own rows (whole groups)
            kept = adv[rows] != 0
            per_micro = [kept[k::micro] for k in range(micro)]  # micro-batch k = rows k, k + m, ...
            full = sum(kept) // len(per_micro[0])
            assert all(p.all() for p in per_micro[:full])  # non-zero rows fill micro-batches 0, 1, ...
            assert not any(p.any() for p in per_micro[full + 1:])  # then at most one mixed, then all zero
    with pytest.raises(ValueError, match="multiple"):
        zero_advantage_order(adv[:47], 2, 3)


def _lora_after(model, config, batch):
    init_state, step = ts.make_train_step(model, config)
    state, metrics = step(init_state(), batch)
    return state, metrics


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6, rtol=0)


@pytest.mark.slow
def test_skipping_equals_training_on_the_kept_rows(lora_model):
    """Group 1's advantages are 0: with the filter its micro-batch is not run and the update equals one made on
    group 0's rows alone (one micro-batch); without zero rows the filter changes nothing."""
    base = dict(grid_hw=GRID, guidance=1.0, adam_eps=1e-6)  # eps: see test_one_mini_batch_is_the_single_update_step
    batch = dataclasses.replace(sampled_batch(lora_model, 1.0),  # no CFG: half the compute, the same logic
                                advantages=np.array([1.0, -1.0, 0.0, 0.0], np.float32))
    dropped = compact_zero_advantage(batch, 1, 2)
    state, m = _lora_after(lora_model, ts.TrainConfig(num_micro_batches=2, drop_zero_advantage=True, **base), dropped)
    assert int(m["micro_skipped"]) == 1 and int(m["skipped"]) == int(m["empty_updates"]) == 0 and int(state.step) == 1
    assert np.isfinite(float(m["ratio_min"])) and float(m["ratio_min"]) == float(m["ratio_max"]) == 1.0
    kept = TrainBatch(**{k: (v[:2] if v.ndim and len(v) == 4 and k != "sigmas" else v)
                         for k, v in batch.arrays().items()})
    want, _ = _lora_after(lora_model, ts.TrainConfig(num_micro_batches=1, **base), kept)
    _close(state.lora, want.lora)
    # the filter off trains on all 4 rows: a different (smaller, halved-mean) update
    off, _ = _lora_after(lora_model, ts.TrainConfig(num_micro_batches=2, **base), batch)
    assert max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
               for a, b in zip(jax.tree.leaves(off.lora), jax.tree.leaves(want.lora))) > 1e-5
    full = sampled_batch(lora_model, 1.0)
    on, _ = _lora_after(lora_model, ts.TrainConfig(num_micro_batches=2, drop_zero_advantage=True, **base),
                        compact_zero_advantage(full, 1, 2))
    off, _ = _lora_after(lora_model, ts.TrainConfig(num_micro_batches=2, **base), full)
    _close(on.lora, off.lora)


@pytest.mark.slow
def test_all_zero_mini_batch_is_not_an_update_and_the_pass_skips_it(lora_model):
    """Two mini-batches (one group each), old log-probs recomputed: the group of equal rewards is no optimizer update
    (Adam's moments and weight decay untouched by it), the other trains; all zero: the state stays as it was."""
    config = ts.TrainConfig(grid_hw=GRID, guidance=4.0, num_micro_batches=1, num_mini_batches=2,
                            old_log_prob="recompute", drop_zero_advantage=True)
    batch = dataclasses.replace(sampled_batch(lora_model, 4.0), advantages=np.array([0.0, 0.0, 1.0, -1.0], np.float32))
    laid = order_minibatches(batch, GROUPS, 2, seed=0, step=0)
    init_state, step = ts.make_train_step(lora_model, config)
    before = jax.tree.map(np.asarray, init_state())
    state, m = step(init_state(), compact_zero_advantage(laid, 2, 1))
    assert int(m["empty_updates"]) == 1 and int(m["micro_skipped"]) == 1 and int(state.step) == 1
    assert int(m["skipped"]) == 0  # "skipped" is a non-finite loss or gradient (the run fails if all are)
    assert any(float(np.abs(np.asarray(a) - b).max()) > 0
               for a, b in zip(jax.tree.leaves(state.lora), jax.tree.leaves(before.lora)))
    state, m = step(init_state(), dataclasses.replace(laid, advantages=np.zeros(4, np.float32)))
    assert int(m["empty_updates"]) == 2 and int(m["micro_skipped"]) == 2 and int(state.step) == 0
    assert int(m["skipped"]) == 0
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_a_later_epoch_s_device_order_compacts_its_shuffled_rows_as_the_host_does():
    import jax.numpy as jnp

    from jaxflow.trainer.minibatches import epoch_order
    rng = np.random.default_rng(1)
    adv = np.where(rng.random(48) < 0.5, 0.0, rng.normal(size=48)).astype(np.float32)
    key = jax.random.key(3)
    perm = np.asarray(jax.random.permutation(key, 48))
    for mini, micro in ((1, 4), (2, 3), (3, 2)):
        got = np.asarray(epoch_order(key, jnp.asarray(adv), mini, micro, True))
        np.testing.assert_array_equal(got, perm[zero_advantage_order(adv[perm], mini, micro)])
    np.testing.assert_array_equal(np.asarray(epoch_order(key, jnp.asarray(adv), 2, 3, False)), perm)
