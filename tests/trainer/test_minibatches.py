"""PPO mini-batches: whole prompt groups per mini-batch (seeded), the old-log-prob pass, per-update ratios and
clipping, M = 1 equal to the single-update step, one compile for every step and mini-batch."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxflow.config import derived
from jaxflow.config import validation as config_lib
from jaxflow.trainer import phases
from jaxflow.trainer import train_step as ts
from jaxflow.algorithms import flowgrpo_step
from jaxflow.trainer.minibatches import combine_metrics, group_order, order_minibatches, select
from jaxflow.nn.lora import LoRAParam
from jaxflow.trainer.train_batch import TrainBatch
from tests.helpers import GRID, GROUPS, sampled_batch, tiny_config


def test_mini_batches_hold_whole_groups_seeded_by_step():
    rng = np.random.default_rng(0)
    group_ids = rng.permutation(np.repeat(np.arange(8), 4))  # 8 groups of 4, rows interleaved
    for m in (2, 4):
        order = group_order(group_ids, m, seed=3, step=7)
        assert sorted(order) == list(range(32))
        parts = [np.asarray(select(jnp.asarray(order), m, j)) for j in range(m)]  # rows as the step reads them
        for rows in parts:
            ids, counts = np.unique(group_ids[rows], return_counts=True)
            assert len(ids) == 8 // m and np.all(counts == 4)  # whole groups only
        assert sorted(np.concatenate([np.unique(group_ids[r]) for r in parts])) == list(range(8))
        np.testing.assert_array_equal(order, group_order(group_ids, m, seed=3, step=7))  # resume: same order
    splits = {tuple(np.unique(group_ids[np.asarray(select(jnp.asarray(group_order(group_ids, 2, 3, s)), 2, 0))]))
              for s in range(6)}
    assert len(splits) > 1  # the step number reshuffles
    batch = TrainBatch(advantages=np.arange(32.0), sigmas=np.linspace(1, 0, 32), noise_level=np.float32(1.2))
    out = order_minibatches(batch, group_ids, 2, 3, 7)
    np.testing.assert_array_equal(out.advantages, group_order(group_ids, 2, 3, 7))
    assert out.sigmas is batch.sigmas and order_minibatches(batch, group_ids, 1, 3, 7) is batch
    # a jax.Array field moves with the rows (it once stayed in place and trained on misaligned rows)
    mixed = order_minibatches(dataclasses.replace(batch, log_probs=jnp.arange(32.0)), group_ids, 2, 3, 7)
    np.testing.assert_array_equal(mixed.log_probs, mixed.advantages)
    with pytest.raises(ValueError, match="num_mini_batches 3"):
        group_order(group_ids, 3, 0, 0)


def _reference_update(model, batch, config):
    """One update as the step made it before mini-batches: accumulated gradients, then AdamW."""
    graphdef, lora, frozen = nnx.split(model, LoRAParam, ...)
    tx = config.optimizer()

    @jax.jit
    def update(lora, frozen, batch):
        grads, _ = flowgrpo_step.accumulate_gradients(graphdef, lora, frozen, batch, config)
        return optax.apply_updates(lora, tx.update(grads, tx.init(lora), lora)[0])
    return update(lora, frozen, jax.tree.map(jnp.asarray, batch))


@pytest.mark.slow
def test_one_mini_batch_is_the_single_update_step(lora_model):
    # Adam's first step is lr * g / (|g| + eps): a reassociation error dg of a near-zero gradient entry moves it by
    # up to lr * dg / eps; eps 1e-6 (not 1e-8) keeps that far below the 1e-6 tolerance whatever XLA fuses.
    config = ts.TrainConfig(grid_hw=GRID, guidance=1.0, num_micro_batches=2, old_log_prob="recompute",
                            adam_eps=1e-6)
    batch = sampled_batch(lora_model, 1.0)
    init_state, step = ts.make_train_step(lora_model, config)
    with phases.recording() as timings:
        state, m = step(init_state(), batch)
    assert set(timings) == {"to_device", "update"} and not any(k.startswith("mb") for k in m)  # no old-log-prob pass
    assert float(m["ratio_min"]) == float(m["ratio_max"]) == 1.0
    want = _reference_update(lora_model, ts.prepare_batch(batch, config), config)
    # the same computation: equal up to float reassociation (LoRA ~0.3, update ~3e-4)
    for got, ref in zip(jax.tree.leaves(state.lora), jax.tree.leaves(want)):
        np.testing.assert_allclose(got, ref, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_two_mini_batches_recompute(lora_model, monkeypatch):
    """M = 2, old log-probs recomputed (true CFG): the first update is on-policy, the second sees the first's
    move (at lr 3e-4 the ratio leaves the 1e-4 clip band); 2 steps x 2 updates trace each function once."""
    traces = {"update": 0, "old": 0}

    def counted(name, fn):
        def wrapper(*args, **kw):
            traces[name] += 1
            return fn(*args, **kw)
        return wrapper
    monkeypatch.setattr(flowgrpo_step, "accumulate_gradients", counted("update", flowgrpo_step.accumulate_gradients))
    monkeypatch.setattr(ts, "old_log_probs", counted("old", ts.old_log_probs))
    config = ts.TrainConfig(grid_hw=GRID, guidance=4.0, num_micro_batches=1, num_mini_batches=2,
                            old_log_prob="recompute", learning_rate=3e-4, clip_range=1e-4)
    batch = order_minibatches(sampled_batch(lora_model, 4.0), GROUPS, 2, seed=0, step=0)
    init_state, step = ts.make_train_step(lora_model, config)
    with phases.recording() as timings:
        state, m = step(init_state(), batch)
    assert set(timings) == {"to_device", "old_log_prob", "update"} and int(state.step) == 2 and int(m["skipped"]) == 0
    # mini-batch 1: the first update, on the pre-update LoRA itself: its own logp is logp_old, the ratio exactly 1
    assert float(m["mb1/ratio_min"]) == float(m["mb1/ratio_max"]) == 1.0
    assert float(m["mb1/clipfrac"]) == 0
    # mini-batch 2 after one Adam step (~lr per param): the ratio moves by ~1e-3 >> the clip range
    moved = max(abs(float(m["mb2/ratio_min"]) - 1), abs(float(m["mb2/ratio_max"]) - 1))
    assert moved > 1e-4 and float(m["mb2/clipfrac"]) > 0 and float(m["mb2/approx_kl"]) > 0
    assert float(m["ratio_min"]) == min(float(m["mb1/ratio_min"]), float(m["mb2/ratio_min"]))
    assert float(m["clipfrac"]) == pytest.approx((float(m["mb1/clipfrac"]) + float(m["mb2/clipfrac"])) / 2)
    assert m["logp_diff_max"].shape == (2,)
    state, m = step(state, order_minibatches(dataclasses.replace(batch, advantages=-batch.advantages), GROUPS, 2, 0, 1))
    assert int(state.step) == 4 and traces == {"update": 1, "old": 1}, traces


@pytest.mark.slow
def test_the_pass_leaves_out_the_first_update_rows_only_in_one_epoch(lora_model):
    """With one inner epoch the recompute pass computes mini-batch 1.. rows only (the first update is on-policy);
    those rows equal the full pass's (two epochs: every row), the first mini-batch's rows are left at 0."""
    from flax import nnx

    from jaxflow.nn.lora import LoRAParam
    batch = order_minibatches(sampled_batch(lora_model, 4.0), GROUPS, 2, seed=0, step=0)
    graphdef, lora, frozen = nnx.split(lora_model, LoRAParam, ...)
    out = {}
    for epochs in (1, 2):
        config = ts.TrainConfig(grid_hw=GRID, guidance=4.0, num_micro_batches=2, num_mini_batches=2,
                                num_inner_epochs=epochs, old_log_prob="recompute")
        prepared = jax.tree.map(jnp.asarray, ts.prepare_batch(batch, config))
        out[epochs] = np.asarray(jax.jit(lambda lo, fr, b, c=config: ts.old_log_probs(graphdef, lo, fr, b, c))(
            lora, frozen, prepared)["log_probs"])
    first = np.arange(len(out[1])) % 2 == 0  # mini-batch 0 = rows 0, 2, 4, ... of the laid-out batch
    assert np.all(out[1][first] == 0) and np.all(out[2][first] != 0)
    np.testing.assert_allclose(out[1][~first], out[2][~first], rtol=0, atol=1e-6)


@pytest.mark.parametrize("key, value", [("train.num_mini_batches", 3), ("train.num_micro_batches", 16),
                                        ("train.num_inner_epochs", 0)])
def test_mini_batch_config_is_validated(tmp_path, key, value):
    cfg = tiny_config(tmp_path, num_mini_batches=2)  # 4 prompts x 4 images: mini-batches of 8 samples
    cfg.train[key.split(".")[1]] = value
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        config_lib.validate(cfg)
    assert derived.train_config(tiny_config(tmp_path, num_mini_batches=2), GRID).num_mini_batches == 2


@pytest.mark.slow  # two steps compiled (two epochs, one epoch)
def test_later_inner_epochs_train_on_the_rows_shuffled_anew(lora_model):
    """Two inner epochs equal two one-epoch steps, the second on the rows in `epoch_order`'s shuffle for (shuffle_seed,
    the step's first update count, epoch 1); the shuffle moves rows between mini-batches (flow_grpo reshuffles)."""
    from jaxflow.trainer.minibatches import epoch_order
    kw = dict(grid_hw=GRID, guidance=1.0, num_micro_batches=1, num_mini_batches=2, adam_eps=1e-6, shuffle_seed=5)
    batch = order_minibatches(sampled_batch(lora_model, 1.0), GROUPS, 2, seed=0, step=0)
    init_state, two = ts.make_train_step(lora_model, ts.TrainConfig(num_inner_epochs=2, **kw))
    got, m = two(init_state(), batch)
    assert int(got.step) == 4 and "mb4/ratio_max" in m
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(5), 0), 1)
    order = np.asarray(epoch_order(key, jnp.asarray(batch.advantages), 2, 1, False))
    assert {frozenset(order[0::2]), frozenset(order[1::2])} != {frozenset({0, 2}), frozenset({1, 3})}
    init_state, one = ts.make_train_step(lora_model, ts.TrainConfig(**kw))
    state, _ = one(init_state(), batch)
    shuffled = TrainBatch(**{k: (v[order] if v.ndim and len(v) == 4 and k != "sigmas" else v)
                             for k, v in batch.arrays().items()})
    want, _ = one(state, shuffled)
    for a, b in zip(jax.tree.leaves(got.lora), jax.tree.leaves(want.lora)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=0)


def test_combined_metrics_name_each_update_only_for_the_keys_it_reports():
    """FlowGRPO's updates report ratios (mb{k}/ratio_min ...); DiffusionNFT's have none, and two of them still combine
    (the mini OCR NFT arm's two mini-batches a step once failed here on a missing ratio_min)."""
    nft = [dict(loss=jnp.float32(v), old_deviate=jnp.float32(0), skipped=jnp.int32(1)) for v in (1.0, 3.0)]
    out = combine_metrics(nft)
    assert float(out["loss"]) == 2.0 and int(out["skipped"]) == 2 and not any(k.startswith("mb") for k in out)
    grpo = [dict(loss=jnp.float32(v), ratio_min=jnp.float32(v), ratio_mean=jnp.float32(1), ratio_max=jnp.float32(v),
                 clipfrac=jnp.float32(0), approx_kl=jnp.float32(0)) for v in (0.5, 2.0)]
    out = combine_metrics(grpo)
    assert float(out["ratio_min"]) == 0.5 and float(out["ratio_max"]) == 2.0
    assert float(out["mb1/ratio_min"]) == 0.5 and float(out["mb2/ratio_max"]) == 2.0
