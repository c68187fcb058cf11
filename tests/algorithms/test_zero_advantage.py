"""train.drop_zero_advantage: rows of equal-reward groups dropped (dealt behind the kept rows; micro-batches left
with none are skipped, the others' dropped rows weigh 0); the update equals training on the kept rows alone, one
micro-batch per update included; nothing trains when every advantage is 0, and the step says so."""

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
    assert int(m["zero_advantage_step"]) == 1 and int(m["rows_dropped"]) == 4
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


def _drift_update(x, mini, micro, drop):
    """(grads, metrics) of `accumulate_gradients` on mini-batch 0 of `x` (jaxflow_bench.algorithm_parity's stand-in
    policy), laid out as the driver does when `drop`."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxflow.algorithms import flowgrpo
    from jaxflow.algorithms.flowgrpo_step import accumulate_gradients
    from jaxflow.algorithms.objective import Objective
    from jaxflow.nn.lora import LoRAParam
    from jaxflow_bench import algorithm_parity as parity

    config = ts.TrainConfig(guidance=1.0, grid_hw=(1, 1), clip_range=parity.ZCLIP, beta=parity.BETA,
                            num_mini_batches=mini, num_micro_batches=micro, drop_zero_advantage=drop)
    order = zero_advantage_order(x["advantages"], mini, micro) if drop else np.arange(len(x["advantages"]))
    batch = {k: jnp.asarray(x[k][order]) for k in ("latents", "sigmas", "step_index", "log_probs", "advantages")}
    graphdef, lora, frozen = nnx.split(parity.Drift(x["p0"]), LoRAParam, ...)
    grads, terms = accumulate_gradients(graphdef, lora, frozen, select(batch, mini, 0), config,
                                        objective=Objective(lambda model, shared, config: shared,
                                                            parity.drift_log_prob))
    metrics = flowgrpo.step_metrics(terms, clip_range=parity.ZCLIP, beta=parity.BETA)
    config.policy.filter.runs(terms, metrics)
    return np.asarray(grads["p"][...]), metrics


@pytest.mark.slow
def test_one_micro_batch_per_update_drops_the_zero_rows():
    """The mini OCR arm's layout (one micro-batch per update): the 10 rows at advantage 0 weigh nothing, KL
    included; the update equals the filter off on the 6 other rows alone (the old filter ran them all: 6/16 of it)."""
    from jaxflow_bench import algorithm_parity as parity

    x = parity.zero_inputs()
    grads, metrics = _drift_update(x, 1, 1, drop=True)
    assert int(metrics["rows_dropped"]) == 10 and int(metrics["micro_skipped"]) == 0
    kept = {k: (v[:6] if k != "p0" else v) for k, v in x.items()}
    want, plain = _drift_update(kept, 1, 1, drop=False)
    np.testing.assert_allclose(grads, want, rtol=0, atol=32 * np.finfo(np.float32).eps * np.abs(want).max())
    np.testing.assert_allclose(float(metrics["loss"]), float(plain["loss"]), rtol=32 * np.finfo(np.float32).eps)
    assert np.abs(want).max() > 0


def test_a_step_with_every_advantage_0_is_no_update_and_is_counted():
    """All advantages 0: no micro-batch runs, the gradient is 0, the step reports zero_advantage_step = 1 (not a
    skipped update, so the run's divergence check does not count it) and its log line says so; flow_grpo's
    trainer would fail on the empty batch."""
    from jaxflow.run.metrics_log import step_line
    from jaxflow.trainer.divergence import SkipStreak
    from jaxflow.trainer.minibatches import combine_metrics
    from jaxflow_bench import algorithm_parity as parity

    x = {**parity.zero_inputs(), "advantages": np.zeros(16, np.float32)}
    updates = []
    for mini, micro in ((2, 2), (1, 1)):
        grads, metrics = _drift_update(x, mini, micro, drop=True)
        assert not grads.any() and int(metrics["empty_updates"]) == 1 and float(metrics["loss"]) == 0.0
        assert int(metrics["rows_dropped"]) == 16 // mini
        updates.append({**metrics, "skipped": np.int32(0)})
    step = combine_metrics(updates)
    assert int(step["zero_advantage_step"]) == 1 and int(step["empty_updates"]) == 2 and int(step["skipped"]) == 0
    streak = SkipStreak(0)
    streak.record(1, bool(step["skipped"]))
    assert not streak.over
    flat = {"step": 1, "reward_mean": 0.5, "reward_std": 0.0, **{k: float(np.mean(v)) for k, v in step.items()}}
    assert "no update (every advantage 0)" in step_line(flat, 3)
    partly = combine_metrics([updates[0], {**updates[0], "empty_updates": np.int32(0)}])
    assert int(partly["zero_advantage_step"]) == 0
