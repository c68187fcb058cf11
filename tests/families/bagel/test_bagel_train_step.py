"""The FlowGRPO train step (make_train_step) on a tiny BAGEL with LoRA, float32 on CPU: the torch rollout
(bagel_sampling, the same seeded weights and adapter, tests/bagel_helpers.py's `sampled`) -> TrainBatch with token
ids -> one step, its ratio, update and loss against families/bagel/objective.py's log-probs; the KL term; shuffled ids;
refusals."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.families.bagel import objective as bf
from jaxflow.algorithms import flowgrpo
from jaxflow.trainer.step_config import TrainConfig
from jaxflow.trainer.train_batch import TrainBatch
from jaxflow.trainer.train_step import make_train_step
from jaxflow.families.bagel.config import TINY
from jaxflow.families.bagel.loading import build
from jaxflow_bridge.families.bagel import keymap as bagel_keymap
from tests.bagel_helpers import GUIDANCE, ROLLOUT_GRID, SP, SPEC, U, arrays, bound, checkpoint, sampled

ADV = np.array([1.0, -1.0, 2.0, -0.5], np.float32)
CONFIG = TrainConfig(grid_hw=ROLLOUT_GRID, guidance=SP.cfg_text_scale, cfg_interval=SP.cfg_interval,
                     cfg_renorm_min=SP.cfg_renorm_min, num_micro_batches=2)


def one_step(model, batch: TrainBatch, config: TrainConfig = CONFIG):
    """(LoRA before, LoRA after, metrics) of one step on `batch`."""
    init_state, step = make_train_step(model, config)
    state = init_state()
    before = jax.tree.map(np.array, state.lora)
    state, metrics = step(state, batch)
    return before, jax.tree.map(np.asarray, state.lora), jax.tree.map(np.asarray, metrics)


@pytest.fixture(scope="module")
def run():  # a torch rollout and a compiled step, ~25 s on 2 cores: the tests that take it are slow
    """The rollout (with a random adapter), its batch arrays, their log-prob bound (B, W) and the step's results."""
    model, out = sampled(adapter=True)
    assert out.prompt_ids is not None and out.prompt_embeds is None
    batch = TrainBatch.of(out, ADV, SP.noise_level)
    return model, out, arrays(out), bound(model, arrays(out)), one_step(model, batch)


@pytest.mark.slow
def test_ratio_is_one_within_the_log_prob_bound(run):
    """logp_old = the rollout's: every micro-batch's ratio exp(logp - logp_old) is 1 within exp(+-max bound)
    (the recomputed logp is within the bound of the rollout's, test_bagel_objective), up to exp's rounding (4 u)."""
    *_, tol, (_, _, metrics) = run
    lo, hi = math.exp(-tol.max()) * (1 - 4 * U), math.exp(tol.max()) * (1 + 4 * U)
    assert lo <= metrics["ratio_min"] <= metrics["ratio_max"] <= hi, (metrics["ratio_min"], metrics["ratio_max"])


@pytest.mark.slow
def test_the_step_updates_the_lora(run):
    *_, (before, after, metrics) = run
    assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert metrics["skipped"] == 0
    changed = jax.tree.map(lambda a, b: bool(np.any(a != b)), before, after)
    assert all(jax.tree.leaves(changed))


@pytest.mark.slow
def test_loss_equals_the_clipped_objective_of_window_log_probs(run):
    """With logp_old = the rollout's minus a shift per row and step (ratios e^+-0.5, inside a clip range of 1), the
    step's loss = mean over rows and window steps of clipped_objective(window_log_probs, logp_old, A).

    Both logp are within the float32 rounding bound b of the rollout's, so |dlogp| <= 2 b; a term moves by at most
    |A| r e^(2 b) 2 b (exp is e^x-Lipschitz), plus the rounding of exp and the product on both sides (8 u |A| r
    each); each mean of n = B W terms, in any order, is within (n + 1) u mean|term| of exact. Advantages paired
    with the wrong rows move the loss by far more than that."""
    model, out, batch, tol, _ = run
    shift = np.array([[0.3, -0.2], [-0.4, 0.1], [0.2, 0.5], [-0.1, -0.3]], np.float32)
    shifted = dataclasses.replace(out, log_probs=out.log_probs - shift)
    config = dataclasses.replace(CONFIG, clip_range=1.0)
    *_, metrics = one_step(model, TrainBatch.of(shifted, ADV, SP.noise_level), config)
    logp = bf.window_log_probs(model, batch, grid_hw=ROLLOUT_GRID, sde_type=config.sde_type, guidance=GUIDANCE)

    def loss(adv):
        terms, ratio = flowgrpo.clipped_objective(logp, jnp.asarray(shifted.log_probs), jnp.asarray(adv)[:, None],
                                                  config.clip_range, config.adv_clip)
        return float(jnp.mean(terms)), np.asarray(terms, np.float64), np.asarray(ratio, np.float64)

    want, terms, ratio = loss(ADV)
    a = np.abs(ADV.astype(np.float64))[:, None]
    moved = a * ratio * np.exp(2 * tol) * 2 * tol + 16 * U * a * ratio
    allowed = moved.mean() + 2 * (terms.size + 1) * U * np.abs(terms).mean()
    assert abs(float(metrics["loss"]) - want) <= allowed, (float(metrics["loss"]), want, allowed)
    assert abs(loss(np.roll(ADV, 1))[0] - want) > 10 * allowed


@pytest.mark.slow
def test_shuffled_ids_move_the_ratio_beyond_the_bound(run):
    """Each sample given the other prompt's context (ids and masks rolled by one group): the step's ratio leaves
    exp(+-max bound) more than tenfold."""
    model, out, _, tol, _ = run
    assert not np.array_equal(out.prompt_ids[0], out.prompt_ids[2])
    roll = {k: np.roll(getattr(out, k), 2, axis=0) for k in ("prompt_ids", "prompt_mask")}
    _, _, metrics = one_step(model, TrainBatch.of(dataclasses.replace(out, **roll), ADV, SP.noise_level))
    moved = max(abs(math.log(metrics["ratio_min"])), abs(math.log(metrics["ratio_max"])))
    assert moved > 10 * tol.max(), (moved, tol.max())


@pytest.mark.slow
def test_beta_adds_the_kl_to_the_model_with_its_adapters_off(run):
    """The rollout's adapter is nonzero, so the policy's SDE mean differs from the adapters-off reference's: kl > 0,
    and (the same first update, on-policy) the loss is the beta = 0 step's plus beta kl, up to the sum's rounding."""
    model, out, *_, (_, _, plain) = run
    beta = 0.04
    _, _, metrics = one_step(model, TrainBatch.of(out, ADV, SP.noise_level), dataclasses.replace(CONFIG, beta=beta))
    assert plain["kl"] == 0 and metrics["kl"] > 0
    total = plain["loss"] + beta * metrics["kl"]
    assert abs(metrics["loss"] - total) <= 16 * U * (abs(plain["loss"]) + beta * metrics["kl"])


def test_bagel_refuses_what_it_cannot_train():
    model = build(TINY, bagel_keymap.to_flax(checkpoint(TINY), TINY.num_hidden_layers), lora=SPEC)  # no rollout
    with pytest.raises(ValueError, match="train.algorithm="):
        make_train_step(model, dataclasses.replace(CONFIG, algorithm="nft", guidance=1.0))


def test_bagel_cfg_fields_are_checked():
    with pytest.raises(ValueError, match="cfg_interval"):
        TrainConfig(guidance=1.0, grid_hw=ROLLOUT_GRID, cfg_interval=(0.9, 0.2))
    with pytest.raises(ValueError, match="cfg_renorm_min"):
        TrainConfig(guidance=1.0, grid_hw=ROLLOUT_GRID, cfg_renorm_min=1.5)
