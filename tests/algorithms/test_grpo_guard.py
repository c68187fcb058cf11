"""train.ratio_norm="guard": GRPO-Guard's ratio is exp(mean((mu - mu_old) eps)) for the sampled
noise eps, the policy term divided by dt; on-policy it is exactly 1; it needs the recompute pass's SDE means."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.config import validation as config_lib
from jaxflow.algorithms import sde
from jaxflow.algorithms import flowgrpo
from jaxflow.trainer import train_step as ts
from jaxflow.trainer.minibatches import order_minibatches
from tests.helpers import GRID, GROUPS, sampled_batch, tiny_config


class LinearVelocity:
    """A stand-in transformer: v = 0.3 x + 0.1 (the terms only need a velocity)."""

    def __call__(self, x, sigma, txt, txt_mask, *, grid_hw, lora_scale=1.0):
        return 0.3 * x + 0.1


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_guard_ratio_is_the_noise_projected_mean_drift(sde_type):
    r = np.random.default_rng(0)
    b, s, c = 3, 6, 4
    x = jnp.asarray(r.normal(size=(b, s, c)), jnp.float32)
    sigma, sigma_next = jnp.full((b,), 0.8), jnp.full((b,), 0.7)
    tr = {"x": x, "sigma": sigma, "sigma_next": sigma_next, "sigma_max": jnp.full((b,), 0.95),
          "noise_level": jnp.full((b,), 0.7), "prompt_embeds": jnp.zeros((b, 2, 8)), "prompt_mask": jnp.ones((b, 2), bool),
          "advantages": jnp.asarray([1.0, -0.5, 2.0])}
    v = LinearVelocity()(x, sigma, None, None, grid_hw=None)
    _, mean, std = sde.sde_step(x, v, sigma, sigma_next, tr["sigma_max"], sde_type=sde_type,
                                noise_level=tr["noise_level"], prev_sample=x)[1:]
    step_std = (std * jnp.sqrt(sigma - sigma_next) if sde_type == "sde" else std)[:, None, None]
    old_mean = mean + 0.05 * jnp.asarray(r.normal(size=mean.shape), jnp.float32)  # the old policy's mean
    eps = jnp.asarray(r.normal(size=mean.shape), jnp.float32)
    x_next = old_mean + step_std * eps  # sampled by the old policy
    old_logp = sde.sde_step(x, v, sigma, sigma_next, tr["sigma_max"], sde_type=sde_type, noise_level=tr["noise_level"],
                            prev_sample=x_next)[1] + jnp.asarray(
        # logp_old under mu_old: shift the new policy's logp by the exact Gaussian difference
        (np.mean(((np.asarray(x_next) - np.asarray(mean)) ** 2 - (np.asarray(x_next) - np.asarray(old_mean)) ** 2)
                 / (2 * np.asarray(step_std) ** 2), axis=(1, 2))))
    tr.update(x_next=x_next, old_log_prob=old_logp, rollout_log_prob=old_logp, old_mean=old_mean)
    kw = dict(grid_hw=GRID, sde_type=sde_type, guidance=1.0, clip_range=1e-4, adv_clip=5.0, beta=0.0)
    terms = flowgrpo.window_step_terms(LinearVelocity(), tr, ratio_norm="guard", **kw)
    want = np.exp(np.mean(np.asarray((mean - old_mean) * eps), axis=(1, 2)))
    np.testing.assert_allclose(np.asarray(terms["ratio"]), want, rtol=1e-5)
    adv = np.asarray(tr["advantages"])
    policy = np.maximum(-adv * want, -adv * np.clip(want, 1 - 1e-4, 1 + 1e-4)) / 0.1
    np.testing.assert_allclose(np.asarray(terms["policy"]), policy, rtol=1e-4)
    # on-policy (no old mean, logp_old = logp): exactly 1
    on = flowgrpo.window_step_terms(LinearVelocity(), {k: v for k, v in tr.items()
                                                       if k not in ("old_mean", "old_log_prob")}, ratio_norm="guard", **kw)
    assert np.all(np.asarray(on["ratio"]) == 1.0)


@pytest.mark.slow
def test_two_mini_batches_with_the_guard(lora_model):
    """M = 2, recompute: the first update is on-policy (ratio exactly 1), the second sees the first's move."""
    config = ts.TrainConfig(grid_hw=GRID, guidance=4.0, num_micro_batches=1, num_mini_batches=2,
                            old_log_prob="recompute", ratio_norm="guard")
    init_state, step = ts.make_train_step(lora_model, config)
    state, m = step(init_state(), order_minibatches(sampled_batch(lora_model, 4.0), GROUPS, 2, seed=0, step=0))
    assert int(state.step) == 2 and int(m["skipped"]) == 0 and np.isfinite(float(m["loss"]))
    assert float(m["mb1/ratio_min"]) == float(m["mb1/ratio_max"]) == 1.0
    assert max(abs(float(m["mb2/ratio_min"]) - 1), abs(float(m["mb2/ratio_max"]) - 1)) > 0


def test_guard_needs_the_recompute_pass(tmp_path):
    cfg = tiny_config(tmp_path)
    cfg.train.update(ratio_norm="guard", old_log_prob="rollout")
    with pytest.raises(ValueError, match="train.ratio_norm"):
        config_lib.validate(cfg)
    with pytest.raises(ValueError, match="recompute"):
        ts.TrainConfig(guidance=1.0, grid_hw=GRID, ratio_norm="guard")
