"""DiffusionNFT (train.algorithm='nft'): its loss against a torch transcription of the paper's formula, the old
policy's decay, the timesteps, the jitted step, and a run of the training program."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxflow.config import derived
from jaxflow.algorithms import nft
from jaxflow.trainer.step_config import TrainConfig
from jaxflow.trainer.train_step import make_train_step
from tests.helpers import ROOT, sampled_batch
from tests.reference_transcriptions import nvlabs_nft_loss


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_loss_and_gradient_match_a_transcription_of_diffusionnft(beta):
    r = np.random.default_rng(0)
    b, s, c = 5, 6, 4
    x0, noise, v, v_old, v_ref = (r.normal(size=(b, s, c)).astype(np.float32) for _ in range(5))
    t = np.array([0.9, 0.5, 0.2, 1.0, 0.05], np.float32)
    adv = np.array([-7.0, -1.0, 0.0, 2.5, 6.0], np.float32)  # both clips, r = 1/2 and the ends
    kl_beta, adv_clip = 0.3, 5.0

    def jax_loss(v):
        xt = nft.noised(x0, noise, t)
        terms = nft.loss_terms(v, v_old, x0, xt, t, adv, nft_beta=beta, adv_clip=adv_clip, v_ref=v_ref)
        return jnp.mean(terms["policy"]) + kl_beta * jnp.mean(terms["kl"]), terms

    (loss, terms), grad = jax.value_and_grad(jax_loss, has_aux=True)(jnp.asarray(v))
    tv = torch.tensor(v, requires_grad=True)
    policy, kl = nvlabs_nft_loss(tv, *(torch.tensor(a) for a in (v_old, v_ref, x0, noise, t, adv)), beta, adv_clip)
    ref = policy.mean() + kl_beta * kl.mean()
    ref.backward()
    np.testing.assert_allclose(terms["policy"], policy.detach().numpy(), rtol=2e-6)
    np.testing.assert_allclose(terms["kl"], kl.detach().numpy(), rtol=2e-6)
    np.testing.assert_allclose(loss, ref.item(), rtol=2e-6)
    np.testing.assert_allclose(grad, tv.grad.numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(terms["old_deviate"], ((v - v_old) ** 2).mean(axis=(1, 2)), rtol=2e-6)


def test_the_gradient_pulls_toward_the_positive_policy_for_good_samples_only():
    """r = 1: the loss is the positive policy's, whose x0 regression moves v toward (x_t - x0) / t; r = 0 pushes
    v the other way; v_old gets no gradient."""
    r = np.random.default_rng(1)
    x0, noise, v_old = (r.normal(size=(1, 4, 2)).astype(np.float32) for _ in range(3))
    t = np.array([0.5], np.float32)
    xt = nft.noised(x0, noise, t)
    target = (xt - x0) / 0.5  # the velocity that reconstructs x0 exactly

    def grad(adv, v, v_old):
        return jax.grad(lambda a, b: jnp.sum(nft.loss_terms(a, b, x0, xt, t, np.float32([adv]), nft_beta=1.0,
                                                            adv_clip=5.0)["policy"]), argnums=(0, 1))(v, v_old)

    up, old_grad = grad(5.0, v_old, v_old)
    down, _ = grad(-5.0, v_old, v_old)
    assert float(jnp.sum(-up * (target - v_old))) > 0  # a descent step moves v toward the target
    assert float(jnp.sum(-down * (target - v_old))) < 0
    assert not np.any(old_grad)


def test_the_loss_reaches_a_fixed_step_from_the_old_policy():
    """With v_old held, a sample's loss is least at v = v_old + (2r - 1)(u - v_old) / beta, u = (x_t - x0) / t:
    r = 1 and r = 0 reconstruct x0 exactly there (the positive or the negative policy equals u), a zero advantage
    leaves v at v_old. So the LoRA's reach is bounded by where the old policy stands (docs/numerics.md §10)."""
    r = np.random.default_rng(2)
    x0, noise, v_old = (r.normal(size=(1, 6, 3)).astype(np.float32) for _ in range(3))
    t, beta = np.array([0.6], np.float32), 0.1
    xt = nft.noised(x0, noise, t)
    u = (xt - x0) / t[0]

    def policy(v, adv):
        return nft.loss_terms(v, v_old, x0, xt, t, np.float32([adv]), nft_beta=beta, adv_clip=5.0)["policy"][0]

    for adv, sign in ((5.0, 1.0), (-5.0, -1.0)):
        reach = v_old + sign * (u - v_old) / beta
        least = float(policy(reach, adv))
        assert least < 1e-4 * float(policy(v_old, adv))
        for _ in range(4):
            assert float(policy(reach + 1e-2 * r.normal(size=reach.shape).astype(np.float32), adv)) > least
    still, pulled = (np.abs(jax.grad(policy)(jnp.asarray(v_old), adv)).max() for adv in (0.0, 5.0))
    assert still < 1e-5 * pulled  # zero but for float32 rounding of the two implicit policies


def test_old_decay_follows_diffusionnfts_schedules():
    flat, rate, cap = 75, 0.0075, 0.999  # its OCR recipe
    got = [float(nft.old_decay(k, flat, rate, cap)) for k in (0, 74, 75, 100, 208, 10_000)]
    np.testing.assert_allclose(got, [0, 0, 0, 0.1875, 0.9975, 0.999], rtol=1e-6)
    assert float(nft.old_decay(300, 0, 0.001, 0.5)) == pytest.approx(0.3)  # its default schedule


def test_timestep_picks_are_distinct_sigmas_of_each_schedule():
    sigmas = np.stack([np.linspace(1, 0, 11), np.linspace(0.9, 0, 11)]).astype(np.float32)
    picks = np.asarray(nft.timestep_picks(jax.random.key(0), sigmas, 9))
    for row, schedule in zip(picks, sigmas):
        assert len(set(row.tolist())) == 9 and set(row.tolist()) <= set(schedule[:-1].tolist())
    other = np.asarray(nft.timestep_picks(jax.random.key(1), sigmas, 9))
    assert not np.array_equal(picks, other)


@pytest.fixture(scope="module")
def tiny_batch(lora_model):
    return lora_model, sampled_batch(lora_model, 1.0)


def _step(model, batch, **kw):
    config = TrainConfig(guidance=1.0, grid_hw=(2, 2), algorithm="nft", num_micro_batches=2, nft_timesteps=3, beta=0.01,
                         learning_rate=1e-2, **kw)
    init_state, step = make_train_step(model, config)
    state = init_state()
    first = jax.tree.map(np.asarray, state.lora)
    state, metrics = step(state, batch)
    return first, jax.tree.map(np.asarray, state), jax.device_get(metrics)


@pytest.mark.slow
def test_the_nft_step_trains_the_lora_and_moves_the_old_policy_by_its_decay(tiny_batch):
    model, batch = tiny_batch
    first, state, metrics = _step(model, batch, nft_decay=(0, 1.0, 0.25))  # one update: decay min(1, 0.25)
    assert int(state.step) == 1 and metrics["skipped"] == 0 and np.isfinite(metrics["loss"])
    assert metrics["old_deviate"] == 0  # one update from the old policy: v = v_old
    leaves = [jax.tree.leaves(t) for t in (first, state.lora, state.old)]
    assert any(not np.allclose(a, b) for a, b in zip(leaves[0], leaves[1]))
    for a, b, old in zip(*leaves):
        np.testing.assert_allclose(old, 0.25 * a + 0.75 * b, rtol=1e-6, atol=1e-7)
    _, flat, _ = _step(model, batch, nft_decay=(5, 1.0, 0.25))  # within the flat start: old = the LoRA
    for a, b in zip(jax.tree.leaves(flat.lora), jax.tree.leaves(flat.old)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_a_skipped_step_moves_neither_the_old_policy_nor_its_decay_and_the_ema_warms_up_as_nvlabs(tiny_batch):
    """NVlabs' EMA (flow_grpo/ema.py, called after global_step += 1): decay min(0.9, (1 + k) / (10 + k)), k = 1 on
    the first update. A step whose update is skipped (non-finite loss) leaves the old policy where it was."""
    model, batch = tiny_batch
    config = TrainConfig(guidance=1.0, grid_hw=(2, 2), algorithm="nft", nft_timesteps=2, learning_rate=1e-2,
                         nft_decay=(0, 0.5, 0.9), ema_decay=0.9)
    init_state, step = make_train_step(model, config)
    state = init_state()
    first = jax.tree.map(np.asarray, state.lora)
    state, metrics = step(state, batch)
    applied = jax.tree.map(np.asarray, state)
    assert int(applied.step) == 1 and metrics["skipped"] == 0
    for a, b, old, ema in zip(*(jax.tree.leaves(t) for t in (first, applied.lora, applied.old, applied.ema))):
        np.testing.assert_allclose(old, 0.5 * a + 0.5 * b, rtol=1e-6, atol=1e-7)  # decay (1 - 0) * 0.5
        np.testing.assert_allclose(ema, 2 / 11 * a + 9 / 11 * b, rtol=1e-6, atol=1e-7)
    bad = dataclasses.replace(batch, advantages=np.full_like(batch.advantages, np.nan))
    state, metrics = step(state, bad)
    assert metrics["skipped"] == 1 and int(state.step) == 1
    for before, after in zip(jax.tree.leaves(applied.old), jax.tree.leaves(jax.tree.map(np.asarray, state.old))):
        np.testing.assert_array_equal(before, after)


def test_the_nft_defaults_are_verl_omnis_qwen_image_recipe_with_nvlabs_ema():
    from jaxflow.config import validation as config_lib
    from jaxflow.config.recipes import base, tiny
    cfg = tiny(base())
    cfg.train.algorithm, cfg.sample.guidance = "nft", 1.0
    tc = derived.train_config(cfg, (2, 2))
    assert (tc.beta, tc.ema_decay, tc.nft_beta, tc.adv_clip, tc.nft_decay) == (1e-4, 0.9, 0.1, 5.0,
                                                                                (75.0, 0.0075, 0.999))
    cfg.train.ema_decay, cfg.train.nft.ema = 0.95, 0.0
    assert derived.train_config(cfg, (2, 2)).ema_decay == 0.95
    cfg.train.ema_decay = 0.0
    assert derived.train_config(cfg, (2, 2)).ema_decay is None
    cfg.train.algorithm = "flowgrpo"  # the other algorithms keep train.beta and train.ema_decay
    assert (derived.train_config(cfg, (2, 2)).beta, derived.train_config(cfg, (2, 2)).ema_decay) == (0.0, None)
    cfg.train.algorithm, cfg.train.beta = "nft", 0.01
    with pytest.raises(config_lib.UserError, match="train.beta.*train.nft.kl"):
        config_lib.validate(cfg)


def test_the_nft_step_needs_the_final_latents_and_refuses_flowgrpo_settings(tiny_batch):
    model, batch = tiny_batch
    _, step = make_train_step(model, TrainConfig(guidance=1.0, grid_hw=(2, 2), algorithm="nft"))
    with pytest.raises(ValueError, match="final_latents.*keep_final"):
        step(None, dataclasses.replace(batch, final_latents=None))
    for kw, needle in (({"guidance": 4.0}, "guidance"), ({"ratio_norm": "guard", "old_log_prob": "recompute"},
                                                        "ratio_norm"),
                       ({"drop_zero_advantage": True}, "drop_zero_advantage"), ({"nft_beta": 0.0}, "nft_beta")):
        with pytest.raises(ValueError, match=needle):
            TrainConfig(grid_hw=(2, 2), algorithm="nft", **{"guidance": 1.0, **kw})


def test_the_mini_ocr_arms_validate_and_set_what_they_name():
    from jaxflow.config import validation as config_lib
    module = config_lib.config_module(ROOT / "configs" / "mini_ocr.py")
    seen = {}
    for variant in module.VARIANTS:
        cfg = module.get_config(variant)
        cfg.model.path = "tiny"
        config_lib.validate(cfg)
        t = cfg.train
        seen[variant] = (t.algorithm, t.ratio_norm, t.old_log_prob, cfg.sample.guidance, cfg.eval.guidance,
                         list(cfg.reward.fns), t.drop_zero_advantage, cfg.sample.solver)
    assert seen["nft"] == ("nft", "none", "recompute", 1.0, 1.0, ["ocr"], False, "euler")
    assert seen["cfgfree"] == ("flowgrpo", "none", "recompute", 1.0, 1.0, ["ocr"], False, "euler")
    assert seen["nft_control"][-3] == ["ocr_shuffled"] and seen["guard"][1] == "guard"
    assert seen["corrected"][2] == "rollout_corrected" and seen[""] == ("flowgrpo", "none", "recompute", 4.0, 4.0,
                                                                        ["ocr"], False, "euler")
    assert seen["dropzero"] == seen[""][:-2] + (True, "euler") and seen["dropzero_control"][-2]
    assert seen["mixgrpo_flash"] == seen["mixgrpo"][:-1] + ("dpm2",) and seen["mixgrpo"][0] == "mixgrpo"
    assert seen["mixgrpo_flash_control"][-1] == "dpm2" and seen["mixgrpo_flash_control"][-3] == ["ocr_shuffled"]
    with pytest.raises(ValueError, match="unknown variant"):
        module.get_config("dpo")
