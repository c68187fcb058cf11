"""train.old_log_prob="rollout_corrected": the rollout's log-probs as logp_old, and a sample's window
step rejected when exp(logp - logp_rollout) leaves [1/t, t]: its policy term trains nothing but it stays in the
loss's denominator, as in verl-omni's bypass mode (tests/algorithms/test_algorithm_parity.py compares with its transcription)."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxflow.config import validation as config_lib
from jaxflow.trainer import train_step as ts
from tests.helpers import GRID, sampled_batch, tiny_config

BASE = dict(grid_hw=GRID, guidance=1.0, num_micro_batches=1, adam_eps=1e-6)  # eps: test_minibatches' reason


def _after(model, batch, **kw):
    init_state, step = ts.make_train_step(model, ts.TrainConfig(**BASE, **kw))
    return step(init_state(), batch)


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6, rtol=0)


@pytest.mark.slow
def test_rejected_rows_train_nothing_and_stay_in_the_denominator(lora_model):
    # the sampler is the trainer's own model: logp - logp_rollout is rounding only
    batch = sampled_batch(lora_model, 1.0)
    shifted = dataclasses.replace(batch, log_probs=batch.log_probs + np.array([[0.01], [0.01], [0.0], [0.0]], np.float32))
    state, m = _after(lora_model, shifted, old_log_prob="rollout_corrected", rejection_threshold=1.001)
    assert float(m["rejected_frac"]) == 0.5  # rows 0 and 1 (|dlogp| 0.01 > log 1.001), both window steps
    # verl-omni weights the rejected 0 and keeps them in the mean: the same update as their advantages at 0
    zeroed = dataclasses.replace(batch, advantages=batch.advantages * np.array([0, 0, 1, 1], np.float32))
    want, _ = _after(lora_model, zeroed, old_log_prob="rollout")
    _close(state.lora, want.lora)
    # nothing beyond the threshold: the same update as old_log_prob="rollout"
    state, m = _after(lora_model, batch, old_log_prob="rollout_corrected", rejection_threshold=1.001)
    assert float(m["rejected_frac"]) == 0.0
    _close(state.lora, _after(lora_model, batch, old_log_prob="rollout")[0].lora)


@pytest.mark.parametrize("key, value", [("train.old_log_prob", "bypass"), ("train.rejection_threshold", 1.0)])
def test_config_is_validated(tmp_path, key, value):
    cfg = tiny_config(tmp_path)
    cfg.train["old_log_prob"] = "rollout_corrected"
    cfg.train[key.split(".")[1]] = value
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        config_lib.validate(cfg)
