"""The train-step benchmark's torch baseline computes the trainer's clipped objective."""
import jax
import numpy as np
import torch

from jaxflow.algorithms import flowgrpo
from jaxflow_bench.torch_step import clipped_objective


def test_torch_clipped_objective_equals_the_trainers():
    rng = np.random.default_rng(0)
    log_prob, old_log_prob = rng.normal(-1.0, 0.3, (2, 64))
    advantages = rng.normal(0.0, 3.0, 64)  # some beyond adv_clip
    with jax.enable_x64(True):
        want_terms, want_ratio = flowgrpo.clipped_objective(log_prob, old_log_prob, advantages, 0.2, 5.0)
        want_terms, want_ratio = np.asarray(want_terms), np.asarray(want_ratio)
    terms, ratio = clipped_objective(*(torch.from_numpy(a) for a in (log_prob, old_log_prob, advantages)), 0.2, 5.0)
    assert want_terms.dtype == np.float64 and terms.dtype == torch.float64
    np.testing.assert_allclose(terms.numpy(), want_terms, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(ratio.numpy(), want_ratio, rtol=1e-12)
