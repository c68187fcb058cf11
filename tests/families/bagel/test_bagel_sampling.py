"""The BAGEL FlowGRPO sampling loop (jaxflow_bridge/families/bagel/sampling.py) over the tiny torch BAGEL, on CPU:
batch independence, seeds, the shifted schedule, log-probs against a float64 recomputation, same_latent, CFG."""
import dataclasses
import math

import numpy as np
import pytest
import torch

from jaxflow.families.bagel.config import TINY
from jaxflow_bridge.contract.schedule import sample_windows, sigma_schedule
from jaxflow_bridge.contract.trajectory import TrajectoryBatch
from jaxflow_bridge.families.bagel.sampling import (BagelSamplingLoop, BagelSamplingParams, guided_velocity,
                                                   latent_preview, pad_ids)
from jaxflow_bridge.families.bagel.model import BagelTorch
from tests import bagel_ref

U = 2.0**-24  # float32 unit roundoff
PROMPT_A, PROMPT_B = [5, 17, 240, 3, 99], [311, 8, 42]
GRID, N = (4, 6), 4  # 64 x 96 pixels; 4 steps, 5 schedule points
SP = BagelSamplingParams(height=64, width=96, num_inference_steps=N, sde_window_range=(0, 3), cfg_text_scale=4.0)
FIRST_STEP = dataclasses.replace(SP, sde_window_size=1, sde_window_range=(0, 1))  # every window starts at step 0


@pytest.fixture(scope="module")
def weights():
    return bagel_ref.weights(TINY)


@pytest.fixture(scope="module")
def model(weights):
    m = BagelTorch(**dataclasses.asdict(TINY))
    m.load_checkpoint(weights)
    return m


@pytest.fixture(scope="module")
def loop(model):
    return BagelSamplingLoop(model)


def initial_noise(seed):
    return torch.randn(GRID[0] * GRID[1], TINY.latent_dim, generator=torch.Generator().manual_seed(seed)).numpy()


def test_schedule_windows_and_fields(loop):
    """sigma_schedule with BAGEL's static shift 3, N + 1 points: 3t / (1 + 2t) on linspace(1, 0, N + 1) within a few
    float32 roundings (the cast, product, sum and quotient); windows from sample_windows; a TrajectoryBatch with
    right-padded ids and, CFG being on, the empty unconditional context (L' = 0)."""
    seeds = [11, 12, 13, 14]
    out = loop.generate([PROMPT_A, PROMPT_B], 2, SP, seeds=seeds, prompts=["a", "b"])
    assert isinstance(out, TrajectoryBatch) and out.text_kind == "ids" and out.prompts == ("a", "a", "b", "b")
    assert out.negative_prompt_ids.shape == out.negative_prompt_mask.shape == (4, 0)
    t = np.linspace(1.0, 0.0, N + 1)
    assert out.sigmas.dtype == np.float32 and len(out.sigmas) == N + 1
    np.testing.assert_array_equal(out.sigmas, sigma_schedule({"shift": 3.0, "use_dynamic_shifting": False}, N, 24))
    np.testing.assert_allclose(out.sigmas, 3 * t / (1 + 2 * t), rtol=4 * U, atol=0)
    starts = sample_windows(np.array(seeds), 2, (0, 3), N)
    np.testing.assert_array_equal(out.step_index, starts[:, None] + np.arange(2))
    assert out.latents.shape == (4, 3, 24, 64) and out.log_probs.shape == (4, 2)
    assert out.images.shape == (4, 64, 96, 3) and out.images.dtype == np.uint8 and out.final_latents is None
    assert out.prompt_mask.sum(1).tolist() == [5, 5, 3, 3] and out.prompt_ids.dtype == np.int32
    np.testing.assert_array_equal(out.prompt_ids[2, :3], PROMPT_B)
    assert out.group_ids.tolist() == [0, 0, 1, 1] and out.seeds.tolist() == seeds
    assert out.policy_versions.tolist() == [0] * 4


def test_a_sample_does_not_depend_on_its_batch(loop):
    """Same prompt and seed alone and between two other samples: the same trajectory. Its velocities differ only by
    the rounding of differently shaped matmuls (within test_bagel_torch's 256-ulp bound), through N = 4 steps."""
    sp = dataclasses.replace(SP, keep_final=True)
    alone = loop.generate([PROMPT_A], 1, sp, seeds=[7])
    mates = loop.generate([PROMPT_B, PROMPT_A, PROMPT_B], 1, sp, seeds=[3, 7, 5])
    tol = N * 256 * U * np.abs(alone.final_latents).max()
    np.testing.assert_array_equal(mates.step_index[1], alone.step_index[0])
    np.testing.assert_allclose(mates.latents[1], alone.latents[0], rtol=0, atol=tol)
    np.testing.assert_allclose(mates.final_latents[1], alone.final_latents[0], rtol=0, atol=tol)
    # d log_prob / d x is z / step_std per element: |z| < 5 and every window step std > 0.5 here
    np.testing.assert_allclose(mates.log_probs[1], alone.log_probs[0], rtol=0, atol=10 * tol)


def test_seeds_change_samples(loop):
    """Each sample starts from its own seed's noise and ends elsewhere for another seed; the same seeds repeat
    bit for bit (windows at step 0 for every seed, so only the noise depends on it)."""
    sp = dataclasses.replace(FIRST_STEP, keep_final=True)
    first = loop.generate([PROMPT_A], 2, sp, seeds=[1, 2])
    again = loop.generate([PROMPT_A], 2, sp, seeds=[1, 2])
    other = loop.generate([PROMPT_A], 2, sp, seeds=[3, 4])
    for field in ("latents", "log_probs", "images", "final_latents"):
        np.testing.assert_array_equal(getattr(first, field), getattr(again, field))
    for b, seed in enumerate([1, 2]):
        np.testing.assert_array_equal(first.latents[b, 0], initial_noise(seed))
    assert not np.allclose(first.final_latents[0], first.final_latents[1])
    assert not np.any(np.isclose(first.final_latents, other.final_latents).all(axis=(1, 2)))


def test_same_latent_gives_one_initial_noise_per_group(loop):
    """Windows start at step 0, so latents[:, 0] is the initial noise: the group's first seed's with same_latent,
    each sample's own without; the step noise stays per sample."""
    seeds = [10, 11, 12, 13, 14, 15]
    shared = loop.generate([PROMPT_A, PROMPT_B], 3, dataclasses.replace(FIRST_STEP, same_latent=True), seeds=seeds)
    own = loop.generate([PROMPT_A, PROMPT_B], 3, FIRST_STEP, seeds=seeds)
    for b, seed in enumerate(seeds):
        np.testing.assert_array_equal(shared.latents[b, 0], initial_noise(seeds[b // 3 * 3]))
        np.testing.assert_array_equal(own.latents[b, 0], initial_noise(seed))
    assert not np.allclose(shared.latents[0, 1], shared.latents[1, 1])


def reference_log_prob(weights, ids, x, x_next, sigma, sigma_next, sigma_max, sp):
    """Gaussian log-density of x_next under the 'sde' step from x (docs/numerics.md §2), float64, with BAGEL's CFG of
    bagel_ref's velocities; also the error bound of the float32 rollout's value (see the test)."""
    x, x_next = x.astype(np.float64), x_next.astype(np.float64)
    v_c, v_u = (bagel_ref.velocity(weights, TINY, c, x.astype(np.float32), float(sigma), GRID).astype(np.float64)
                for c in (ids, []))
    v = v_u + sp.cfg_text_scale * (v_c - v_u)
    v *= min(max(np.linalg.norm(v_c) / (np.linalg.norm(v) + 1e-8), sp.cfg_renorm_min), 1.0)
    dt = float(sigma_next) - float(sigma)
    std = sp.noise_level * math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma)))
    v_coef = (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
    mean = x * (1 + std**2 * dt / (2 * sigma)) + v * v_coef
    step_std = std * math.sqrt(-dt)
    z = (x_next - mean) / step_std
    log_prob = np.mean(-0.5 * z**2 - math.log(step_std) - 0.5 * math.log(2 * math.pi))
    # The rollout's v differs by <= 256 u max|v| per branch (test_bagel_torch), times (2 scale + 2) through CFG and
    # renorm; its mean adds a few roundings of each term. d log_prob / d mean is z / step_std per element.
    err_mean = abs(v_coef) * (2 * sp.cfg_text_scale + 2) * 256 * U * max(np.abs(v_c).max(), np.abs(v_u).max())
    err_mean += 8 * U * (np.abs(x).max() + np.abs(v * v_coef).max())
    return log_prob, np.abs(z).max() * err_mean / step_std + 8 * U * (1 + np.max(z**2))


def test_log_probs_match_a_float64_recomputation(loop, weights):
    seeds = [21, 22, 23, 24]
    out = loop.generate([PROMPT_A, PROMPT_B], 2, SP, seeds=seeds)
    assert 0 in out.step_index[:, 0]  # a window through sigma = 1 (sigma_max in the std)
    for b in range(4):
        ids = [int(i) for i in out.prompt_ids[b, out.prompt_mask[b]]]
        for k, i in enumerate(out.step_index[b]):
            want, tol = reference_log_prob(weights, ids, out.latents[b, k], out.latents[b, k + 1], out.sigmas[i],
                                           out.sigmas[i + 1], out.sigmas[1], SP)
            assert abs(out.log_probs[b, k] - want) <= tol, (b, k, out.log_probs[b, k], want, tol)


def test_log_probs_average_minus_a_half_minus_the_log_step_std(loop):
    """At sampling time E[log p] = -1/2 - log(step std) - log sqrt(2 pi) ('sde', docs/numerics.md §8): the loop draws its
    step noise at the std its log-prob uses. Each log-prob is a mean over S x C = 1536 elements, whose -z^2/2 has
    variance 1/2: within 4 standard errors, 4 sqrt(0.5 / 1536) = 0.072."""
    out = loop.generate([PROMPT_A, PROMPT_B], 2, dataclasses.replace(SP, cfg_text_scale=1.0), seeds=[31, 32, 33, 34])
    sig, idx = out.sigmas.astype(np.float64), out.step_index
    s, s_next = sig[idx], sig[idx + 1]
    std = SP.noise_level * np.sqrt(s / (1 - np.where(s == 1, sig[1], s))) * np.sqrt(s - s_next)
    np.testing.assert_allclose(out.log_probs, -0.5 - np.log(std) - 0.5 * np.log(2 * np.pi),
                               atol=4 * math.sqrt(0.5 / (GRID[0] * GRID[1] * TINY.latent_dim)))


class CountingModel:
    """Counts velocity calls over the empty (unconditional) context."""

    def __init__(self, model):
        self.model, self.latent_dim, self.unconditional = model, model.latent_dim, 0

    def prefill(self, ids, mask):
        return self.model.prefill(ids, mask)

    def velocity(self, x, sigma, context, grid):
        self.unconditional += context.mask.shape[1] == 0
        return self.model.velocity(x, sigma, context, grid)


def test_cfg_scale_one_is_the_conditional_path(model):
    """Scale 1: no unconditional forward, the same trajectory as an interval no step enters; scale 4 runs one per
    step in the interval (lo, hi] and changes the samples."""
    counting = CountingModel(model)
    loop = BagelSamplingLoop(counting)
    plain = loop.generate([PROMPT_A], 2, dataclasses.replace(SP, cfg_text_scale=1.0), seeds=[5, 6])
    assert counting.unconditional == 0 and not plain.guided and plain.prompts == ("", "")
    never = loop.generate([PROMPT_A], 2, dataclasses.replace(SP, cfg_interval=(1.0, 1.0)), seeds=[5, 6])
    assert counting.unconditional == 0
    np.testing.assert_array_equal(plain.latents, never.latents)
    np.testing.assert_array_equal(plain.log_probs, never.log_probs)
    guided = loop.generate([PROMPT_A], 2, dataclasses.replace(SP, cfg_interval=(0.5, 1.0)), seeds=[5, 6])
    assert counting.unconditional == int(np.sum((guided.sigmas[:N] > 0.5) & (guided.sigmas[:N] <= 1.0)))
    assert not np.allclose(guided.latents[:, -1], plain.latents[:, -1])


def test_guided_velocity_renorms_each_sample():
    """Per sample: v = v_u + s (v_c - v_u) scaled by clamp(|v_c| / |v|, min, 1); a sample whose guided norm is below
    its conditional one keeps factor 1, whatever its batch mate's norms."""
    rng = np.random.default_rng(0)
    v_c, v_u = rng.standard_normal((2, 2, 5, 3))
    v_u[1] = v_c[1] * 1.2  # sample 1: |v| = 0.4 |v_c| -> factor 1
    v_c[0] *= 10.0  # sample 0 dominates any norm taken over the batch
    for renorm_min in (0.0, 0.9):
        got = guided_velocity(torch.from_numpy(v_c).float(), torch.from_numpy(v_u).float(), 3.0, renorm_min).numpy()
        for b in range(2):
            v = v_u[b] + 3.0 * (v_c[b] - v_u[b])
            want = v * np.clip(np.linalg.norm(v_c[b]) / (np.linalg.norm(v) + 1e-8), renorm_min, 1.0)
            np.testing.assert_allclose(got[b], want, rtol=64 * U, atol=64 * U * np.abs(want).max())


def test_keep_final_and_the_stand_in_decode(loop):
    out = loop.generate([PROMPT_B], 2, dataclasses.replace(SP, keep_final=True), seeds=[8, 9])
    assert out.final_latents.shape == (2, 24, 64) and out.final_latents.dtype == np.float32
    np.testing.assert_array_equal(out.images, latent_preview(torch.from_numpy(out.final_latents), GRID))
    # token (r, c) holds latent pixels (2r + p, 2c + q) in (p, q, channel) order; each covers 8 x 8 image pixels
    tokens = torch.zeros(1, 24, 64)
    tokens[0, 1 * 6 + 2, (1 * 2 + 0) * 16 + 2] = 10.0  # token (1, 2), p = 1, q = 0, channel 2 (blue)
    img = latent_preview(tokens, GRID)[0]
    assert img[24, 32].tolist() == [128, 128, 255] and img[16, 32].tolist() == [128, 128, 128]


@pytest.mark.parametrize("change, message", [
    ({"height": 70}, "multiples of 16"),
    ({"cfg_text_scale": 0.5}, "cfg_text_scale must be >= 1"),
    ({"cfg_interval": (0.8, 0.2)}, "cfg_interval"),
    ({"sde_type": "ddim"}, "sde_type"),
    ({"sde_window_size": 4}, "SDE window size 4"),
])
def test_bad_requests_are_refused_by_name(loop, change, message):
    with pytest.raises(ValueError, match=message):
        loop.generate([PROMPT_A], 1, dataclasses.replace(SP, **change))


def test_bad_prompts_and_keys_are_refused(loop):
    with pytest.raises(ValueError, match="unknown BAGEL sampling parameters"):
        BagelSamplingParams.from_dict({"true_cfg_scale": 4.0})
    with pytest.raises(ValueError, match="non-empty token id lists"):
        loop.generate([PROMPT_A, []], 1, SP)
    with pytest.raises(ValueError, match=r"one text per prompt_ids entry \(2\), got 1"):
        loop.generate([PROMPT_A, PROMPT_B], 1, SP, prompts=["a"])
    ids, mask = pad_ids([PROMPT_B, PROMPT_A])
    assert ids.shape == (2, 5) and mask.sum(1).tolist() == [3, 5] and not ids[0, 3:].any()
