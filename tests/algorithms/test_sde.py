"""Sigma schedule and SDE step: JAX spec vs torch mirror vs diffusers, plus the FlowGRPO invariants (docs/numerics.md §1-3, §8)."""

import ast
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxflow.algorithms import sde as J
from jaxflow_bridge.contract import schedule
from jaxflow_bridge.families.qwen_image import spec as qwen_spec
from jaxflow_bridge.rollout import sde as T

QWEN = qwen_spec.SCHEDULER_CONFIG
MODULES = [J, T]
ROOT = Path(__file__).resolve().parents[2]


def run(module, x, v, sigma, sigma_next, sigma_max, *, noise=None, prev_sample=None, **kw):
    """sde_step of either module on numpy inputs; outputs as float numpy arrays."""
    to = (lambda a: a) if module is J else torch.from_numpy
    out = module.sde_step(
        to(x),
        to(v),
        sigma,
        sigma_next,
        sigma_max,
        noise=None if noise is None else to(noise),
        prev_sample=None if prev_sample is None else to(prev_sample),
        **kw,
    )
    return [np.asarray(o) if module is J else o.numpy() for o in out]


def max_diffs(a, b):
    return [float(np.abs(p - q).max()) for p, q in zip(a, b)]


def cps_cancellation(x, v, sigma, sigma_next, a):
    """Bound on |JAX - torch| of the 'cps' mean from sqrt(sigma_next**2 - std**2), std = sigma_next sin(a pi/2):
    as a -> 1 the difference cancels, so float32 rounding of its two terms (and a 1-ulp sin) is amplified. The
    difference carries an absolute error of up to delta = 8 eps sigma_next**2; its sqrt then errs by at most
    min(delta / (2 sqrt(y)), sqrt(delta)), times |x1| = |x + (1 - sigma) v|; two sides, hence 2x."""
    shape = (-1,) + (1,) * (x.ndim - 1)
    sigma, sn, a = (np.asarray(t, np.float64).reshape(shape) for t in (sigma, sigma_next, a))
    y = sn**2 * np.cos(a * np.pi / 2) ** 2
    delta = 8 * np.finfo(np.float32).eps * sn**2
    err = np.minimum(delta / (2 * np.sqrt(np.maximum(y, 1e-300))), np.sqrt(delta))
    return 2 * np.abs(x + (1 - sigma) * v) * err


def step_inputs(rng, shape, sigmas, idx):
    """Random x, v, noise of `shape` and per-sample (sigma, sigma_next) for step indices idx."""
    x, v, eps = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    idx = np.asarray(idx)
    return x, v, eps, sigmas[idx], sigmas[idx + 1]


# ---------------------------------------------------------------------------------------------- schedule


def diffusers_sigmas(cfg, n, seq):
    sch = FlowMatchEulerDiscreteScheduler.from_config(cfg)
    c = sch.config
    mu = calculate_shift(seq, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    sch.set_timesteps(sigmas=np.linspace(1.0, 1.0 / n, n), mu=mu)
    return sch.sigmas.numpy()


SCHEDULE_CASES = [
    (QWEN, 10, 1024),
    (QWEN, 50, 4096),
    (QWEN, 50, 6889),
    (QWEN, 4, 1024),
    (QWEN, 2, 16),
    (QWEN, 20, 8192),
    (dict(QWEN, time_shift_type="linear"), 10, 1024),
    ({}, 10, 1024),
    ({}, 1, 64),
    (dict(shift=3.0), 10, 4096),
    (dict(shift=3.0, shift_terminal=0.05), 7, 256),
]


@pytest.mark.parametrize("cfg,n,seq", SCHEDULE_CASES)
def test_sigma_schedule_matches_diffusers(cfg, n, seq):
    got = schedule.sigma_schedule(cfg, n, seq)
    ref = diffusers_sigmas(cfg, n, seq)
    assert got.dtype == np.float32 and got.shape == (n + 1,)
    assert np.array_equal(got, ref), np.abs(got - ref).max()
    assert got[0] == 1.0 and got[-1] == 0.0


def test_sigma_schedule_known_qwen_values():
    """diffusers' FlowMatchEulerDiscreteScheduler with Qwen-Image's scheduler config (docs/numerics.md §1)."""
    np.testing.assert_allclose(schedule.sigma_schedule(QWEN, 4, 1024)[:4], [1.0, 0.7492682, 0.4325879, 0.01999992], atol=1e-7)
    s = schedule.sigma_schedule(QWEN, 50, 4096)
    np.testing.assert_allclose(s[[0, 1, 2, 3, -3, -2, -1]], [1, 0.9897009, 0.9791915, 0.9684653, 0.0584758, 0.01999998, 0], atol=1e-7)


def test_pixels_per_token_is_the_vaes_factor_times_the_2x2_patch():
    """Qwen-Image's VAE (three temporal-downsample entries: 8x) gives 16 pixels a token; the tiny model's (two) 8."""
    from jaxflow_bridge.families.qwen_image.full_size import VAE_CONFIG
    from jaxflow_bridge.families.qwen_image.spec import pixels_per_token
    from jaxflow_bridge.families.qwen_image.tiny import TINY_VAE_CONFIG
    assert pixels_per_token(VAE_CONFIG) == 16 and pixels_per_token(TINY_VAE_CONFIG) == 8


def test_sigma_schedule_rejects_unsupported():
    with pytest.raises(ValueError, match="use_karras_sigmas"):
        schedule.sigma_schedule(dict(QWEN, use_karras_sigmas=True), 10, 1024)
    with pytest.raises(ValueError, match="num_steps"):
        schedule.sigma_schedule(QWEN, 1, 1024)


# ---------------------------------------------------------------------------------------------- step parity


@pytest.mark.parametrize("sde_type", J.SDE_TYPES)
@pytest.mark.parametrize("mode", ["sample", "prev_sample"])
def test_step_jax_equals_torch(sde_type, mode):
    rng = np.random.default_rng(0)
    sigmas = schedule.sigma_schedule(QWEN, 10, 1024)
    x, v, eps, s, sn = step_inputs(rng, (5, 32, 16), sigmas, [0, 3, 5, 8, 9])
    a = np.array([1.2, 0.0, 0.7, 0.9, 1.5], np.float32)
    kw = dict(sde_type=sde_type, noise_level=a)
    if mode == "sample":
        kw["noise"] = eps
    else:  # the stored next latent of another rollout draw
        kw["prev_sample"] = run(T, x, v, s, sn, sigmas[1], noise=eps[::-1].copy(), **kw)[0]
    out_j = run(J, x, v, s, sn, sigmas[1], **kw)
    out_t = run(T, x, v, s, sn, sigmas[1], **kw)
    for o in out_j + out_t:
        assert o.dtype == np.float32 and np.isfinite(o).all()
    assert out_j[1].shape == out_j[3].shape == (5,)
    assert max(max_diffs(out_j, out_t)) <= 1e-6, max_diffs(out_j, out_t)


def test_step_jit_equals_eager():
    rng = np.random.default_rng(1)
    sigmas = schedule.sigma_schedule(QWEN, 10, 1024)
    x, v, eps, s, sn = step_inputs(rng, (2, 8, 4), sigmas, [0, 4])
    for sde_type in J.SDE_TYPES:
        kw = dict(sde_type=sde_type, noise_level=np.float32(0.8))
        jitted = jax.jit(lambda *args, noise: J.sde_step(*args, noise=noise, **kw))(x, v, s, sn, sigmas[1], noise=eps)
        eager = J.sde_step(x, v, s, sn, sigmas[1], noise=eps, **kw)
        assert max(max_diffs(jitted, eager)) <= 1e-6


def test_kl_term_jax_equals_torch():
    rng = np.random.default_rng(2)
    mean, ref = (rng.standard_normal((3, 8, 4)).astype(np.float32) for _ in range(2))
    std = np.array([0.5, 0.0, 2.0], np.float32)
    kl_j = np.asarray(J.kl_term(mean, ref, std))
    kl_t = T.kl_term(torch.from_numpy(mean), torch.from_numpy(ref), torch.from_numpy(std)).numpy()
    want = ((mean - ref) ** 2).mean(axis=(1, 2)) / (2 * np.where(std > 0, std, 1) ** 2) * (std > 0)
    np.testing.assert_allclose(kl_j, want, rtol=1e-6)
    assert kl_j.dtype == np.float32 and np.abs(kl_j - kl_t).max() <= 1e-6


def test_prev_sample_recompute_ratio_one_and_gradients():
    """Recomputing the stored latent gives log_prob bit-equal to sampling time; grads go through mean only."""
    rng = np.random.default_rng(3)
    sigmas = schedule.sigma_schedule(QWEN, 10, 1024)
    x, v, eps, s, sn = step_inputs(rng, (3, 16, 8), sigmas, [0, 2, 6])
    kw = dict(sde_type="sde", noise_level=np.array([1.2, 0.0, 0.7], np.float32))
    for module in MODULES:
        prev, logp, _, _ = run(module, x, v, s, sn, sigmas[1], noise=eps, **kw)
        again = run(module, x, v, s, sn, sigmas[1], prev_sample=prev, **kw)[1]
        assert np.array_equal(logp, again)

    def jax_loss(v_, prev_):
        return J.sde_step(x, v_, s, sn, sigmas[1], prev_sample=prev_, **kw)[1].sum()

    gv_j, gp_j = jax.grad(jax_loss, argnums=(0, 1))(jnp.asarray(v), jnp.asarray(prev))
    v_t = torch.from_numpy(v).requires_grad_()
    prev_t = torch.from_numpy(prev).requires_grad_()
    T.sde_step(x, v_t, s, sn, sigmas[1], prev_sample=prev_t, **kw)[1].sum().backward()
    assert np.all(np.asarray(gp_j) == 0) and prev_t.grad is None
    assert np.isfinite(np.asarray(gv_j)).all() and np.all(np.asarray(gv_j)[1] == 0)  # sample 1 has a = 0
    assert np.abs(np.asarray(gv_j) - v_t.grad.numpy()).max() <= 1e-6


# ---------------------------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("module", MODULES, ids=["jax", "torch"])
def test_noise_level_zero_is_euler(module):
    """a = 0: 'sde' and 'ode' are Euler bit for bit, CPS within 2e-6 (fp32 rounding of its algebraic form)."""
    rng = np.random.default_rng(4)
    sigmas = schedule.sigma_schedule(QWEN, 10, 1024)
    x, v, eps, s, sn = step_inputs(rng, (4, 32, 16), sigmas, [0, 3, 8, 9])
    euler = x + v * (sn - s)[:, None, None]
    for sde_type, tol in [("sde", 0.0), ("ode", 0.0), ("cps", 2e-6)]:
        prev, logp, mean, std = run(module, x, v, s, sn, sigmas[1], sde_type=sde_type, noise_level=0.0, noise=eps)
        assert np.abs(prev - euler).max() <= tol and np.abs(mean - euler).max() <= tol
        assert np.all(logp == 0) and np.all(std == 0)
    # per-sample noise levels: the a = 0 samples stay Euler while the others are noisy
    a = np.array([0.0, 1.2, 0.0, 0.7], np.float32)
    prev, logp, _, _ = run(module, x, v, s, sn, sigmas[1], sde_type="sde", noise_level=a, noise=eps)
    assert np.array_equal(prev[a == 0], euler[a == 0]) and np.all(logp[a == 0] == 0)
    assert np.all(np.abs(prev - euler).reshape(4, -1).max(axis=1)[a > 0] > 1e-3)


@pytest.mark.parametrize("module", MODULES, ids=["jax", "torch"])
def test_sde_first_step_std_is_noise_level(module):
    rng = np.random.default_rng(5)
    for n, seq in [(10, 1024), (50, 4096), (2, 16)]:
        sigmas = schedule.sigma_schedule(QWEN, n, seq)
        x, v, eps, s, sn = step_inputs(rng, (3, 4), sigmas, [0, 0, 0])
        a = np.array([0.7, 1.2, 1.5], np.float32)
        std = run(module, x, v, s, sn, sigmas[1], sde_type="sde", noise_level=a, noise=eps)[3]
        np.testing.assert_allclose(std * np.sqrt(sigmas[0] - sigmas[1]), a, rtol=1e-6)


@pytest.mark.parametrize("module", MODULES, ids=["jax", "torch"])
@pytest.mark.parametrize("a", [0.7, 1.2])
def test_sampling_log_prob_expectation(module, a):
    """E[log p] = -0.5 - log(step_std) - 0.9189 ('sde') and -step_std^2 ('cps'), within 4 standard errors."""
    rng = np.random.default_rng(6)
    sigmas = schedule.sigma_schedule(QWEN, 10, 1024)
    steps = np.array([0, 2, 5, 8])
    x, v, eps, s, sn = step_inputs(rng, (4, 256, 64), sigmas, steps)
    n = 256 * 64
    _, logp, _, std = run(module, x, v, s, sn, sigmas[1], sde_type="sde", noise_level=a, noise=eps)
    step_std = std * np.sqrt(s - sn)
    np.testing.assert_allclose(logp, -0.5 - np.log(step_std) - 0.5 * math.log(2 * math.pi), atol=4 * math.sqrt(0.5 / n))
    _, logp, _, std = run(module, x, v, s, sn, sigmas[1], sde_type="cps", noise_level=a, noise=eps)
    np.testing.assert_allclose(logp, -(std**2), atol=4 * std.max() ** 2 * math.sqrt(2 / n))


def test_step0_log_prob_near_minus_1_06():
    """docs/numerics.md §8: 'sde', a = 0.7, step 0 has step std 0.7, so log p ~ -1.419 - ln 0.7 = -1.062."""
    rng = np.random.default_rng(7)
    sigmas = schedule.sigma_schedule(QWEN, 10, 1024)
    x, v, eps, s, sn = step_inputs(rng, (1, 16, 64, 64), sigmas, [0])
    logp = run(J, x, v, s, sn, sigmas[1], sde_type="sde", noise_level=0.7, noise=eps)[1]
    assert abs(float(logp[0]) + 1.062) < 0.02


# ---------------------------------------------------------------------------------------------- properties


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 3),
    tail=st.sampled_from([(3,), (2, 5), (2, 3, 4)]),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    cfg=st.sampled_from([QWEN, {}]),
    num_steps=st.integers(2, 20),
    seq=st.integers(16, 8192),
    sde_type=st.sampled_from(J.SDE_TYPES),
    recompute=st.booleans(),
    data=st.data(),
)
def test_step_properties(batch, tail, dtype, cfg, num_steps, seq, sde_type, recompute, data):
    sigmas = schedule.sigma_schedule(cfg, num_steps, seq)
    idx = np.array(data.draw(st.lists(st.integers(0, num_steps - 1), min_size=batch, max_size=batch)))
    # a is 0 (outside the window) or a real noise level; a tiny nonzero a underflows step_std**2 in fp32
    levels = st.one_of(st.just(0.0), st.floats(0.0625, 1.5, width=32))
    a = np.array(data.draw(st.lists(levels, min_size=batch, max_size=batch)), np.float32)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    x, v, eps, s, sn = step_inputs(rng, (batch, *tail), sigmas, idx)
    # round the inputs to the test dtype once; both modules then see identical values
    tdt = getattr(torch, dtype)
    x_t, v_t, eps_t = (torch.from_numpy(arr).to(tdt) for arr in (x, v, eps))
    x_j, v_j, eps_j = (jnp.asarray(t.float().numpy()).astype(getattr(jnp, dtype)) for t in (x_t, v_t, eps_t))
    kw = dict(sde_type=sde_type, noise_level=a)
    if recompute:
        prev = T.sde_step(x_t, v_t, s, sn, sigmas[1], noise=eps_t.flip(0), **kw)[0].to(tdt)
        out_t = T.sde_step(x_t, v_t, s, sn, sigmas[1], prev_sample=prev, **kw)
        out_j = J.sde_step(x_j, v_j, s, sn, sigmas[1], prev_sample=jnp.asarray(prev.float().numpy()).astype(getattr(jnp, dtype)), **kw)
    else:
        out_t = T.sde_step(x_t, v_t, s, sn, sigmas[1], noise=eps_t, **kw)
        out_j = J.sde_step(x_j, v_j, s, sn, sigmas[1], noise=eps_j, **kw)
    extra = cps_cancellation(np.asarray(x_j, np.float32), np.asarray(v_j, np.float32), s, sn, a) \
        if sde_type == "cps" else 0.0
    for i, (o_j, o_t) in enumerate(zip(out_j, out_t)):
        o_j, o_t = np.asarray(o_j), o_t.numpy()
        assert o_j.dtype == o_t.dtype == np.float32
        assert np.isfinite(o_j).all() and np.isfinite(o_t).all()
        atol = 1e-6 + (extra if i in (0, 2) else 0.0)  # prev_sample and mean carry the cps term
        np.testing.assert_array_less(np.abs(o_j - o_t), atol + 1e-6 * np.abs(o_t))
    assert out_j[1].shape == out_j[3].shape == (batch,)


# ---------------------------------------------------------------------------------------------- windows


def test_sample_windows_deterministic_and_independent():
    seeds = [3, 17, 123456, 0]
    first = schedule.sample_windows(seeds, 2, (0, 5), 10)
    assert first.dtype == np.int32 and first.shape == (4,)
    assert np.array_equal(first, schedule.sample_windows(seeds, 2, (0, 5), 10))
    assert all(schedule.sample_windows([sd], 2, (0, 5), 10)[0] == st_ for sd, st_ in zip(seeds, first))


@pytest.mark.parametrize("size,window_range,num_steps", [(2, (0, 5), 10), (3, (1, 10), 6), (1, (0, 100), 4), (4, (0, 5), 5)])
def test_sample_windows_range_and_last_step(size, window_range, num_steps):
    starts = schedule.sample_windows(range(300), size, window_range, num_steps)
    hi = min(window_range[1], num_steps - 1)
    assert starts.min() == window_range[0] and starts.max() == hi - size  # whole range reached, inclusive
    assert (starts + size - 1).max() <= num_steps - 2  # never the schedule's last step
    levels = schedule.window_noise_levels(starts, size, num_steps, 1.2)
    assert levels.shape == (300, num_steps) and levels.dtype == np.float32
    assert np.all((levels > 0).sum(axis=1) == size) and np.all(levels[:, -1] == 0)
    assert np.all(levels[np.arange(300), starts] == np.float32(1.2))


@pytest.mark.parametrize("size", [0, None])
def test_sample_windows_full(size):
    starts = schedule.sample_windows([1, 2], size, (3, 4), 6)
    assert np.array_equal(starts, [0, 0])
    levels = schedule.window_noise_levels(starts, size, 6, np.array([0.5, 0.9], np.float32))
    np.testing.assert_array_equal(levels, np.float32([[0.5] * 5 + [0], [0.9] * 5 + [0]]))


@pytest.mark.parametrize(
    "size,window_range,num_steps",
    [(5, (0, 5), 5), (3, (2, 4), 10), (3, (5, 20), 7), (10, (0, 20), 10), (2, (-1, 5), 10), (-1, (0, 5), 10)],
)
def test_sample_windows_rejects_bad_sizes(size, window_range, num_steps):
    with pytest.raises(ValueError, match="SDE window size"):
        schedule.sample_windows([0], size, window_range, num_steps)


# ---------------------------------------------------------------------------------------------- layering


@pytest.mark.parametrize("path,forbidden", [("jaxflow/algorithms/sde.py", {"torch"}), ("jaxflow_bridge/rollout/sde.py", {"jax"}),
                                            ("jaxflow_bridge/contract/schedule.py", {"jax", "torch"})])
def test_framework_isolation(path, forbidden):
    """Each step module imports its own framework and the shared numpy schedule only; the schedule neither."""
    tree = ast.parse((ROOT / path).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    roots = {name.split(".")[0] for name in names if name != "jaxflow_bridge.contract.schedule"}
    assert not roots & (forbidden | {"jaxflow", "jaxflow_bridge"})
