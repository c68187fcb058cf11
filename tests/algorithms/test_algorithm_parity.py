"""Algorithm parity against the references' transcriptions (tests/reference_transcriptions.py) on identical float32
inputs: `jaxflow_bench.algorithm_parity`'s figures, recomputed here and read from the committed
benchmarks/results/algorithm_parity.json.

Tolerance: the loss is a mean over B = 8 samples of about ten float32 operations each (exp, clip, max, a mean over
S x C = 64 elements), so its rounding error is within (10 + log2(64) + log2(8)) eps ~ 19 eps; TOL = 32 eps leaves
headroom for the different summation orders of XLA and torch. The gradient's, relative to its largest entry,
likewise. The zero-advantage filter's update sums at most 6 kept rows x 2 window steps of the same per-row terms
(S x C = 32 elements): (10 + log2(32) + log2(12)) eps ~ 19 eps, the same bound."""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxflow.config import derived
from jaxflow.config import validation as config_lib
from jaxflow.algorithms import rollout_correction
from jaxflow_bench import algorithm_parity as parity
from tests import reference_transcriptions as ref
from tests.helpers import tiny_config

TOL = 32 * float(np.finfo(np.float32).eps)
RESULT = Path(__file__).parents[2] / "benchmarks" / "results" / "algorithm_parity.json"
EQUAL = ["grpo_guard_batch_vs_verl_omni", *(f"rollout_corrected_{o}_vs_verl_omni_bypass"
                                            for o in ("token_k1", "token_k2", "token_k3")),
         *(f"zero_advantage_{layout}_vs_flow_grpo_sd3" for layout in parity.ZERO_LAYOUTS),
         *(f"recompute_corrected_{name}_vs_verl" for name in parity.DECOUPLED)]


@pytest.fixture(scope="module")
def figures():
    return parity.figures()


@pytest.mark.parametrize("name", EQUAL)
def test_equal_to_the_reference_to_float32_rounding(figures, name):
    for key in ("loss_rel", "grad_rel"):
        assert figures[name][key] <= TOL, (name, key, figures[name][key])


def test_committed_figures_are_the_scripts(figures):
    saved = json.loads(RESULT.read_text())
    assert saved["name"] == "algorithm_parity" and saved["device"]
    for name in EQUAL:
        for key in ("loss_rel", "grad_rel"):
            assert saved["figures"][f"{name}/{key}"] <= TOL
    # the paper's per-sample normalization is not verl-omni's when a micro-batch mixes SDE steps
    for key in ("loss_rel", "grad_rel"):
        assert figures["grpo_guard_sample_vs_verl_omni"][key] > 1e-2
        np.testing.assert_allclose(saved["figures"][f"grpo_guard_sample_vs_verl_omni/{key}"],
                                   figures["grpo_guard_sample_vs_verl_omni"][key], rtol=1e-3)


def test_inputs_reject_some_window_steps():
    x = parity.inputs()
    for option, t in (("token_k1", 2.0), ("token_k2", 0.1), ("token_k3", 0.1)):
        kept = np.asarray(rollout_correction.keep_mask(jnp.asarray(x["dlogp"]), option, t))
        assert 0 < kept.sum() < len(kept), option


@pytest.mark.parametrize("option, t", [("token_k1", 2.0), ("token_k1", 1.001), ("token_k2", 0.05),
                                       ("token_k3", 0.02)])
def test_keep_mask_is_verls(option, t):
    lr = np.concatenate([np.linspace(-3, 3, 601), [-40.0, 40.0, np.log(t), -np.log(t)]]).astype(np.float32)
    want = ref.verl_token_rejection_mask(torch.tensor(lr)[:, None], option, t)[:, 0].numpy().astype(bool)
    got = np.asarray(rollout_correction.keep_mask(jnp.asarray(lr), option, t))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("key, value, extra", [
    ("train.rollout_rs", "seq_mean_k1", {"old_log_prob": "rollout_corrected"}),
    ("train.rejection_threshold", 1.0, {"old_log_prob": "rollout_corrected"}),
    ("train.guard_stats", "step", {"ratio_norm": "guard", "old_log_prob": "recompute"}),
    ("train.guard_clip_range", 0.0, {"ratio_norm": "guard", "old_log_prob": "recompute"})])
def test_new_keys_are_validated(tmp_path, key, value, extra):
    cfg = tiny_config(tmp_path)
    for k, v in {**extra, key.split(".")[1]: value}.items():
        cfg.train[k] = v
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        config_lib.validate(cfg)


def test_k2_threshold_may_be_below_one(tmp_path):
    cfg = tiny_config(tmp_path)
    cfg.train.update(old_log_prob="rollout_corrected", rollout_rs="token_k2", rejection_threshold=0.05)
    config_lib.validate(cfg)


def _log_ratio():  # (B, W): some steps far off, some at the bounds
    r = np.random.default_rng(3)
    lr = r.normal(0, 0.4, (64, 3)).astype(np.float32)
    lr[0, 0], lr[1, 1], lr[2] = 40.0, -40.0, np.log(2.0) / 3
    return lr


@pytest.mark.parametrize("option", sorted(rollout_correction.RS_OPTIONS))
def test_sequence_and_token_masks_are_verls(option):
    lr = _log_ratio()
    for t in ((1.5, 2.0) if option.endswith("k1") else (0.02, 0.1)):
        want = ref.verl_rejection_mask(torch.tensor(lr), option, t).numpy().astype(bool)
        got = np.asarray(rollout_correction.keep_mask(jnp.asarray(lr), option, t))
        np.testing.assert_array_equal(got, want)
        assert 0 < want.sum() < want.size, (option, t)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_is_weights_are_verls(level):
    lr = _log_ratio()
    for t in (1.2, 2.0):
        want = ref.verl_is_weights(torch.tensor(lr), level, t).numpy()
        got = np.asarray(rollout_correction.is_weights(jnp.asarray(lr), level, t))
        np.testing.assert_allclose(got, want, rtol=4 * float(np.finfo(np.float32).eps), atol=0)
        assert (want == t).any() and (want < t).any()


def test_decoupled_inputs_reject_some_window_steps():
    x = parity.decoupled_inputs()
    lr = jnp.asarray(x["old_log_probs"] - x["log_probs"])
    for _, option, t in parity.DECOUPLED.values():
        if option != "off":
            kept = np.asarray(rollout_correction.keep_mask(lr, option, t))
            assert 0 < kept.sum() < kept.size, option


@pytest.mark.parametrize("key, value, extra", [
    ("train.rollout_is", "token", {"old_log_prob": "rollout_corrected"}),
    ("train.rollout_is", "geometric", {"old_log_prob": "recompute_corrected"}),
    ("train.rollout_is_threshold", 0.0, {"old_log_prob": "recompute_corrected", "rollout_is": "token"}),
    ("train.rollout_rs", "seq_max_k1", {"old_log_prob": "recompute_corrected"}),
    ("train.rollout_is", "off", {"old_log_prob": "recompute_corrected", "rollout_rs": "off"})])
def test_correction_keys_are_validated(tmp_path, key, value, extra):
    cfg = tiny_config(tmp_path)
    for k, v in {**extra, key.split(".")[1]: value}.items():
        cfg.train[k] = v
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        config_lib.validate(cfg)


def test_decoupled_sequence_options_are_accepted(tmp_path):
    cfg = tiny_config(tmp_path)
    cfg.train.update(old_log_prob="recompute_corrected", rollout_is="sequence", rollout_rs="seq_mean_k3",
                     rejection_threshold=0.02)
    config_lib.validate(cfg)
    config = derived.train_config(cfg, (1, 1))
    assert config.recompute_pass and not config.pass_skips_first  # the pass scores every row, even for one update
