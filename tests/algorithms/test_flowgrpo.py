"""FlowGRPO algorithm pieces: advantages, the clipped objective and its metrics, true-CFG velocity."""

import ast
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxflow.algorithms import flowgrpo
from jaxflow.algorithms.advantages import compute_advantages
from jaxflow.families.qwen_image.config import QwenImageConfig
from jaxflow.nn.config import ModelOptions
from jaxflow.families.qwen_image.transformer import QwenImageTransformer

ROOT = Path(__file__).resolve().parents[2]
TINY = QwenImageConfig(num_layers=2, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=64,
                       axes_dims_rope=(8, 12, 12))

# ---------------------------------------------------------------------------------------------- advantages


def test_advantages_hand_computed_global_std():
    adv, zero = compute_advantages([1.0, 2.0, 3.0, 5.0], [0, 0, 1, 1])
    # group means 1.5 and 4; batch std of [1, 2, 3, 5] = sqrt(8.75 / 4)
    want = np.array([-0.5, 0.5, -1.0, 1.0]) / (math.sqrt(2.1875) + 1e-4)
    np.testing.assert_allclose(adv, want, rtol=1e-6)
    assert adv.dtype == np.float32 and zero == 0.0


def test_advantages_group_std_and_eps():
    adv, _ = compute_advantages([1.0, 2.0, 3.0, 5.0], [0, 0, 1, 1], global_std=False)
    np.testing.assert_allclose(adv, [-0.5 / 0.5001, 0.5 / 0.5001, -1 / 1.0001, 1 / 1.0001], rtol=1e-6)
    # a spread of 1e-4: std 5e-5, so A = 5e-5 / (5e-5 + eps)
    adv, _ = compute_advantages([0.0, 1e-4], [3, 3], global_std=False)
    np.testing.assert_allclose(adv, [-1 / 3, 1 / 3], rtol=1e-5)
    adv, _ = compute_advantages([0.0, 1e-4], [3, 3], global_std=False, eps=0.0)
    np.testing.assert_allclose(adv, [-1.0, 1.0], rtol=1e-6)


def test_advantages_clamp():
    rewards, groups = [0.0, 0.0, 0.0, 10.0], [0] * 4  # mean 2.5, std sqrt(18.75)
    adv, _ = compute_advantages(rewards, groups)
    np.testing.assert_allclose(adv, np.array([-2.5] * 3 + [7.5]) / (math.sqrt(18.75) + 1e-4), rtol=1e-6)
    adv, _ = compute_advantages(rewards, groups, clip=1.5)
    np.testing.assert_allclose(adv, [-2.5 / (math.sqrt(18.75) + 1e-4)] * 3 + [1.5], rtol=1e-6)


def test_advantages_zero_std_groups_any_size_and_order():
    rewards = [1.0, 4.0, 2.0, 0.1, 3.0, 0.1, 0.1, 4.0]
    groups = [0, 2, 1, 5, 1, 5, 5, 2]  # interleaved; sizes 1, 2, 2, 3
    adv, zero = compute_advantages(rewards, groups)
    assert zero == 0.75  # groups 0 (one sample), 2 and 5 are constant
    assert np.all(adv[[0, 1, 3, 5, 6, 7]] == 0.0)
    assert adv[2] < 0 < adv[4] and adv[2] == -adv[4]


def test_advantages_incomplete_group_error():
    with pytest.raises(ValueError, match="group 9 has 2 samples, expected 3"):
        compute_advantages([1, 2, 3, 4, 5], [7, 7, 7, 9, 9], expected_group_size=3)
    compute_advantages([1, 2, 3, 4, 5, 6], [7, 7, 7, 9, 9, 9], expected_group_size=3)
    with pytest.raises(ValueError, match="must be equal"):
        compute_advantages([1.0, 2.0], [0])


# ---------------------------------------------------------------------------------------------- objective

RATIO = np.array([0.8, 1.05, 1.2, 0.8, 1.2], np.float32)
ADV = np.array([1.0, 1.0, 1.0, -1.0, -1.0], np.float32)


def test_clipped_objective_hand_computed():
    logp, old = jnp.log(jnp.asarray(RATIO)), jnp.zeros(5)
    terms, ratio = flowgrpo.clipped_objective(logp, old, jnp.asarray(ADV), clip_range=0.1, adv_clip=5.0)
    np.testing.assert_allclose(ratio, RATIO, rtol=1e-6)
    # max(-A r, -A clip(r, 0.9, 1.1)): the pessimistic (larger) term
    np.testing.assert_allclose(terms, [-0.8, -1.05, -1.1, 0.9, 1.2], rtol=1e-6)
    terms, _ = flowgrpo.clipped_objective(jnp.zeros(2), jnp.zeros(2), jnp.array([10.0, -7.0]), 1e-4, 5.0)
    np.testing.assert_allclose(terms, [-5.0, 5.0])  # advantages clamped to +-adv_clip


def test_objective_gradient_sign():
    def loss(logp):
        return jnp.mean(flowgrpo.clipped_objective(logp, jnp.zeros(5), jnp.asarray(ADV), 0.1, 5.0)[0])

    grad = np.asarray(jax.grad(loss)(jnp.log(jnp.asarray(RATIO))))
    # A > 0 unclipped: raising logp lowers the loss; A < 0 unclipped: the opposite; clipped terms: no gradient
    assert grad[0] < 0 and grad[1] < 0 and grad[4] > 0
    assert grad[2] == 0 and grad[3] == 0


def test_step_metrics():
    log_ratio = jnp.log(jnp.asarray(RATIO)).reshape(1, 1, 5)
    terms = {"ratio": jnp.asarray(RATIO).reshape(1, 1, 5), "log_ratio": log_ratio, "dlogp": 0.5 * log_ratio,
             "policy": jnp.arange(5.0).reshape(1, 1, 5), "kl": jnp.full((1, 1, 5), 2.0)}
    m = flowgrpo.step_metrics(terms, clip_range=0.1, beta=0.5)
    assert float(m["clipfrac"]) == pytest.approx(0.8)
    assert float(m["clipfrac_gt_one"]) == pytest.approx(0.4) and float(m["clipfrac_lt_one"]) == pytest.approx(0.4)
    assert float(m["ratio_min"]) == pytest.approx(0.8) and float(m["ratio_max"]) == pytest.approx(1.2)
    assert float(m["ratio_mean"]) == pytest.approx(RATIO.mean())
    assert float(m["approx_kl"]) == pytest.approx(0.5 * np.mean(np.log(RATIO) ** 2), rel=1e-5)
    assert float(m["loss"]) == pytest.approx(2.0 + 0.5 * 2.0) and float(m["policy_loss"]) == pytest.approx(2.0)
    # per window step: terms (M=2, W=3, b=2)
    dlogp = jnp.asarray(np.arange(12.0).reshape(2, 3, 2) * np.array([1, -1])).astype(jnp.float32)
    m = flowgrpo.step_metrics({**terms, "dlogp": dlogp}, clip_range=0.1, beta=0.0)
    np.testing.assert_allclose(m["logp_diff_mean"], [(0 + 1 + 6 + 7) / 4, (2 + 3 + 8 + 9) / 4, (4 + 5 + 10 + 11) / 4])
    np.testing.assert_allclose(m["logp_diff_max"], [7, 9, 11])


# ---------------------------------------------------------------------------------------------- true CFG


@pytest.mark.slow
def test_guided_velocity_batched_or_split_matches_separate_calls():
    """Negatives as long as the prompts run in one batched call (within fp32 rounding of two calls); negatives padded
    shorter (sample.negative_max_sequence_length) run as their own call: exactly the two calls' CFG."""
    model = QwenImageTransformer(TINY, ModelOptions(), rngs=nnx.Rngs(0))
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(2, 4, 64)), jnp.float32)
    sigma = jnp.array([0.9, 0.4])
    pos, pos_mask = jnp.asarray(r.normal(size=(2, 5, 64)), jnp.float32), jnp.array([[1] * 5, [1] * 3 + [0] * 2], bool)
    neg, neg_mask = jnp.asarray(r.normal(size=(2, 3, 64)), jnp.float32), jnp.array([[1] * 3, [1] * 2 + [0]], bool)
    neg_long, neg_long_mask = jnp.pad(neg, ((0, 0), (0, 2), (0, 0))), jnp.pad(neg_mask, ((0, 0), (0, 2)))

    @jax.jit
    def run(x, sigma, pos, pos_mask, neg, neg_mask):
        v_pos = model(x, sigma, pos, pos_mask, grid_hw=(2, 2))
        v_neg = model(x, sigma, neg, neg_mask, grid_hw=(2, 2))
        split = flowgrpo.guided_velocity(model, x, sigma, pos, pos_mask, neg, neg_mask, grid_hw=(2, 2), guidance=4.0)
        batched = flowgrpo.guided_velocity(model, x, sigma, pos, pos_mask, neg_long, neg_long_mask, grid_hw=(2, 2),
                                           guidance=4.0)
        plain = flowgrpo.guided_velocity(model, x, sigma, pos, pos_mask, grid_hw=(2, 2), guidance=1.0)
        return v_pos, v_neg, split, batched, plain

    v_pos, v_neg, split, batched, plain = (np.asarray(a) for a in run(x, sigma, pos, pos_mask, neg, neg_mask))
    comb = v_neg + 4.0 * (v_pos - v_neg)
    want = comb * np.linalg.norm(v_pos, axis=-1, keepdims=True) / np.linalg.norm(comb, axis=-1, keepdims=True)
    np.testing.assert_allclose(batched, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(split, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(plain, v_pos)
    with pytest.raises(ValueError, match="negative prompt"):
        flowgrpo.guided_velocity(model, x, sigma, pos, pos_mask, grid_hw=(2, 2), guidance=4.0)


@pytest.mark.parametrize("path", ["jaxflow/algorithms/flowgrpo.py", "jaxflow/trainer/train_step.py", "jaxflow/trainer/sharding.py"])
def test_no_torch_import(path):
    tree = ast.parse((ROOT / path).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert "torch" not in {name.split(".")[0] for name in names}
    # the torch side's only module the JAX math may read is the framework-free contract (test_layering: no torch)
    assert all(name.startswith("jaxflow_bridge.contract") for name in names if name.split(".")[0] == "jaxflow_bridge")
