"""Algorithm parity against the references' transcriptions (tests/reference_transcriptions.py) on identical float32
inputs: `jaxflow_bench.algorithm_parity`'s figures, recomputed here and read from the committed
benchmarks/results/algorithm_parity.json.

Tolerance: the loss is a mean over B = 8 samples of about ten float32 operations each (exp, clip, max, a mean over
S x C = 64 elements), so its rounding error is within (10 + log2(64) + log2(8)) eps ~ 19 eps; TOL = 32 eps leaves
headroom for the different summation orders of XLA and torch. The gradient's, relative to its largest entry,
likewise. The zero-advantage filter's update sums at most 6 kept rows x 2 window steps of the same per-row terms
(S x C = 32 elements): (10 + log2(32) + log2(12)) eps ~ 19 eps, the same bound. DiffusionNFT's and AWM's loss
(`flow_matching_parity`) is likewise a mean over 5 or 6 samples of about ten operations on S x C = 24 or 128
elements ((10 + 7 + 3) eps ~ 20 eps at most; AWM's reference in float64 adds nothing): the same TOL. The samplers'
(`sampling_parity`) bounds are derived where they are asserted."""

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
from jaxflow_bench import flow_matching_parity, sampling_parity
from tests import reference_transcriptions as ref
from tests.helpers import tiny_config

TOL = 32 * float(np.finfo(np.float32).eps)
RESULT = Path(__file__).parents[2] / "benchmarks" / "results" / "algorithm_parity.json"
EQUAL = ["grpo_guard_batch_vs_verl_omni", *(f"rollout_corrected_{o}_vs_verl_omni_bypass"
                                            for o in ("token_k1", "token_k2", "token_k3")),
         *(f"nft_beta{beta:g}_vs_nvlabs" for beta in flow_matching_parity.NFT_BETAS), "awm_vs_official"]
EQUAL_UPDATES = [*(f"zero_advantage_{layout}_vs_flow_grpo_sd3" for layout in parity.ZERO_LAYOUTS),
                 *(f"recompute_corrected_{name}_vs_verl" for name in parity.DECOUPLED)]


@pytest.fixture(scope="module")
def figures():
    return parity.loss_figures()


@pytest.fixture(scope="module")
def update_figures():
    return parity.update_figures()


@pytest.mark.parametrize("name", EQUAL)
def test_equal_to_the_reference_to_float32_rounding(figures, name):
    for key in ("loss_rel", "grad_rel"):
        assert figures[name][key] <= TOL, (name, key, figures[name][key])


@pytest.mark.slow
def test_whole_updates_equal_the_reference_to_float32_rounding(figures, update_figures):
    """The zero-advantage filter's and decoupled correction's updates (half a minute of CPU); and the committed
    file holds exactly the script's comparisons, these included."""
    saved = json.loads(RESULT.read_text())["figures"]
    assert set(saved) == {f"{name}/{key}" for name, d in {**figures, **update_figures}.items() for key in d}
    for name in EQUAL_UPDATES:
        for key in ("loss_rel", "grad_rel"):
            assert update_figures[name][key] <= TOL and saved[f"{name}/{key}"] <= TOL, (name, key)


def _step_bounds() -> dict:
    """{sde_type: (log_prob_abs, mean_rel, grad_rel) bounds} of the SDE step's parity: the mean, about six float32
    operations on x and v, within d = 8 eps (|x| + |v|); d moves x' - mean = step_std noise, so the 'sde' log-prob
    -(x' - mean)^2 / (2 step_std^2) by up to d |noise| / step_std and 'cps''s -(x' - mean)^2 by 2 step_std |noise| d
    (plus 8 eps of the log-prob's own size); its gradient, (x' - mean) / step_std^2 times the mean's, by d /
    step_std^2 against its largest entry's |noise| / step_std."""
    x, eps = sampling_parity.step_inputs(), float(np.finfo(np.float32).eps)
    s, sn, a = x["sigma"], x["sigma_next"], sampling_parity.STEP_LEVEL
    d = 8 * eps * float(np.abs(x["x"]).max() + np.abs(x["v"]).max())
    noise = float(np.abs(x["noise"]).max())
    sde_std = float(np.min(a * np.sqrt(s / (1 - np.where(s == 1, x["sigma_max"], s)) * (s - sn))))
    cps_std = sn * np.sin(a * np.pi / 2)
    lp_sde = float(np.max(np.abs(-0.5 - np.log(sde_std) - 0.5 * np.log(2 * np.pi)))) + noise ** 2
    return {"sde": (d * noise / sde_std + 8 * eps * lp_sde, 8 * eps, d / (sde_std * noise) + 8 * eps),
            "cps": (2 * float(cps_std.max()) * noise * d + 8 * eps * float(cps_std.max() * noise) ** 2, 8 * eps,
                    d / (float(cps_std.min()) * noise) + 8 * eps)}


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_the_sde_step_is_flow_grpos_to_float32_rounding(figures, sde_type):
    got = figures[f"flowgrpo_{sde_type}_step_vs_flow_grpo"]
    lp_abs, mean_rel, grad_rel = _step_bounds()[sde_type]
    assert got["log_prob_abs"] <= lp_abs and got["mean_rel"] <= mean_rel and got["grad_rel"] <= grad_rel, got


def _flash_bounds() -> tuple[float, float]:
    """(latents_rel, log_prob_abs) bounds of the Flash sampler's parity: a few float32 roundings per step on values of
    size ~|x| over the N steps, 8 N eps relative; a window step's log-prob -(x' - mean)^2 / (2 step_std^2) with
    x' - mean = step_std noise moves by the latents' error over step_std, times |noise|."""
    sigmas, v_fn, x, noises = sampling_parity.flash_inputs()
    eps, n = float(np.finfo(np.float32).eps), sampling_parity.FLASH_STEPS
    latents, _ = sampling_parity.flash_sample(sigmas, v_fn, x, noises)
    s, sn = sigmas[:-2], sigmas[1:-1]  # every step a window may take (the last never is)
    step_std = sampling_parity.FLASH_LEVEL * np.sqrt(s / (1 - np.where(s == 1, sigmas[1], s)) * (s - sn))
    err = 8 * n * eps * float(latents.abs().max())
    return 8 * n * eps, err / float(step_std.min()) * float(noises.abs().max())


def test_mixgrpo_flash_and_window_are_the_officials(figures):
    latents_rel, lp_abs = _flash_bounds()
    flash = figures["mixgrpo_flash_sampler_vs_official"]
    assert flash["latents_rel"] <= latents_rel and flash["log_prob_abs"] <= lp_abs, flash
    window = figures["mixgrpo_window_vs_official"]
    assert window["mismatched_starts"] == 0 and window["compared"] > 1000, window


def test_committed_figures_are_the_scripts(figures):
    saved = json.loads(RESULT.read_text())
    assert saved["name"] == "algorithm_parity" and saved["device"]
    assert {f"{name}/{key}" for name, d in figures.items() for key in d} <= set(saved["figures"])
    assert saved["command"] == "python -m jaxflow_bench.algorithm_parity"
    for sde_type, (lp_abs, mean_rel, grad_rel) in _step_bounds().items():
        name = f"flowgrpo_{sde_type}_step_vs_flow_grpo"
        assert saved["figures"][f"{name}/log_prob_abs"] <= lp_abs and saved["figures"][f"{name}/mean_rel"] <= mean_rel
        assert saved["figures"][f"{name}/grad_rel"] <= grad_rel
    latents_rel, lp_abs = _flash_bounds()
    assert saved["figures"]["mixgrpo_flash_sampler_vs_official/latents_rel"] <= latents_rel
    assert saved["figures"]["mixgrpo_flash_sampler_vs_official/log_prob_abs"] <= lp_abs
    assert saved["figures"]["mixgrpo_window_vs_official/mismatched_starts"] == 0
    assert saved["figures"]["mixgrpo_window_vs_official/compared"] == figures["mixgrpo_window_vs_official"]["compared"]
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
