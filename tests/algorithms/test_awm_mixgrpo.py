"""AWM's loss and MixGRPO's window schedule against transcriptions of their official code."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxflow.algorithms import awm, mixgrpo
from jaxflow.trainer.step_config import TrainConfig
from tests.reference_transcriptions import MixGRPOTrainingStates, awm_official_loss


def test_awm_loss_and_gradient_match_a_transcription_of_the_official_trainer():
    rng = np.random.default_rng(0)
    b, s, c = 6, 16, 8
    v, v_ref, x0, noise = (rng.standard_normal((b, s, c)).astype(np.float32) for _ in range(4))
    t = rng.uniform(0.05, 0.95, b).astype(np.float32)
    adv = (3 * rng.standard_normal(b)).astype(np.float32)  # some beyond adv_clip
    kw = dict(power=0.25, adv_clip=2.0, adv_max=1.0, clip_range=1.0)

    def ours(v):
        terms = awm.loss_terms(v, jnp.asarray(x0), jnp.asarray(noise), jnp.asarray(t), jnp.asarray(adv),
                               v_ref=jnp.asarray(v_ref), **kw)
        return jnp.mean(terms["policy"]) + 0.003 * jnp.mean(terms["kl"])

    loss, grad = jax.value_and_grad(ours)(jnp.asarray(v))
    tv = torch.tensor(v, dtype=torch.float64, requires_grad=True)
    ref = awm_official_loss(tv, *(torch.tensor(x, dtype=torch.float64) for x in (v_ref, x0, noise, t, adv)),
                          beta=0.003, **kw)
    ref.backward()
    # float32 against float64: each per-sample mean over s * c = 128 terms and one power; rounding ~1e-6 relative
    np.testing.assert_allclose(float(loss), ref.item(), rtol=2e-6)
    g = tv.grad.numpy()
    assert np.max(np.abs(np.asarray(grad) - g)) <= 2e-6 * np.max(np.abs(g))
    assert np.max(np.abs(g)) > 0


def test_awm_timestep_indices_are_one_per_stratum_as_discrete_wo_init():
    """Official: boundaries = linspace(1, int(N * fraction), T + 1).long(), index lo + long(u (hi - lo))."""
    idx = np.asarray(awm.step_indices(jax.random.key(3), 14, 6, 0.9))
    edges = torch.linspace(1, int(14 * 0.9), steps=7).long().numpy()
    assert ((idx >= edges[:-1]) & ((idx < edges[1:]) | (edges[1:] == edges[:-1]))).all()


@pytest.mark.parametrize("steps,size,interval,stride", [(25, 4, 25, 1), (10, 2, 3, 1), (10, 3, 2, 2)])
def test_mixgrpo_window_slides_as_the_official_schedule(steps, size, interval, stride):
    ref = MixGRPOTrainingStates(interval, size, steps - 2, stride)
    full = 0
    for k in range(4 * steps * interval):
        window = ref.window()
        start = mixgrpo.window_start(k, num_steps=steps, size=size, window_range=(0, steps), interval=interval,
                                     stride=stride)
        assert 0 <= start and start + size <= steps - 1  # the project keeps the window whole, the last step out
        if len(window) == size:  # where the official window is whole, the same steps
            assert list(range(start, start + size)) == window, k
            full += 1
        ref.update()
    assert full > 0


def test_mixgrpo_narrows_the_rollouts_window_range_to_the_steps_window():
    from jaxflow.algorithms import registry
    from jaxflow.config.recipes import base, tiny
    cfg = tiny(base())
    cfg.train.algorithm = "mixgrpo"
    cfg.sample.update(num_steps=10, window_size=2, window_range=(0, 9))
    cfg.train.mixgrpo.update(interval=2, stride=1)
    ranges = [registry.rollout_sampling({"sde_window_range": (0, 9)}, cfg, k)["sde_window_range"] for k in range(20)]
    assert ranges[:6] == [(0, 2), (0, 2), (1, 3), (1, 3), (2, 4), (2, 4)] and ranges[14:16] == [(7, 9), (7, 9)]
    assert ranges[16:18] == [(7, 9), (7, 9)]  # the reference's cur 8 (window [8]) as the whole window ending at 9
    assert ranges[18] == (0, 2)  # back to the start
    cfg.train.algorithm = "flowgrpo"
    assert registry.rollout_sampling({"sde_window_range": (0, 9)}, cfg, 5) == {"sde_window_range": (0, 9)}


def test_the_new_entries_are_registered_with_their_rules():
    assert TrainConfig(guidance=1.0, grid_hw=(2, 2), algorithm="mixgrpo").policy.loss.name == "mixgrpo"
    assert TrainConfig(guidance=1.0, grid_hw=(2, 2), algorithm="awm").policy.loss.name == "awm"
    for kw, needle in (({"algorithm": "awm", "awm_timesteps": 0}, "awm_timesteps"),
                       ({"algorithm": "mixgrpo", "mixgrpo_interval": 0}, "mixgrpo_interval"),
                       ({"algorithm": "mixgrpo", "sde_type": "ode"}, "sde_type")):
        with pytest.raises(ValueError, match=needle):
            TrainConfig(guidance=1.0, grid_hw=(2, 2), **kw)
