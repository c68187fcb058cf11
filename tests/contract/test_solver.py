"""jaxflow_bridge/contract/solver.py and rollout/solver.py: 'dpm2' is NVlabs DiffusionNFT's second-order sampler
(against a transcription of its solver.py), is second order (its error falls ~4x when the steps double, Euler's ~2x,
on a flow with a closed-form solution), and 'euler' is the SDE step unchanged; 'dpm2' with an SDE is MixGRPO-Flash's
sampler (against a transcription of its run_sample_step), the window's steps those of 'euler'."""
import numpy as np
import pytest
import torch

from jaxflow_bridge.contract.schedule import sigma_schedule, window_noise_levels
from jaxflow_bridge.contract.solver import dpm2_coefficients, solver_choice
from jaxflow_bridge.rollout.sde import sde_step
from jaxflow_bridge.rollout.solver import Solver
from tests.reference_transcriptions import mixgrpo_flash_sampling, nvlabs_nft_dpm2_sampling

SHIFTED = {"shift": 3.0, "use_dynamic_shifting": False}


def _field(seed: int, c: int = 8):
    """A seeded nonlinear velocity field v(x, sigma) on (B, S, C) latents."""
    g = torch.Generator().manual_seed(seed)
    w, u = torch.randn(c, c, generator=g) / c ** 0.5, torch.randn(c, generator=g)
    return lambda x, sigma: torch.tanh(x @ w) + float(sigma) * u


def _run(solver: Solver, v_fn, x, sigmas):
    for i in range(len(sigmas) - 1):
        x, log_prob = solver.step(x, v_fn(x, sigmas[i]), i)
        assert not torch.any(log_prob)
    return x


@pytest.mark.parametrize("config, steps", [(SHIFTED, 10), ({"shift": 1.0}, 6), (SHIFTED, 16), (SHIFTED, 2)])
def test_dpm2_is_nvlabs_dpm_solver_to_float32_rounding(config, steps):
    sigmas = sigma_schedule(config, steps, 16)
    v_fn, x = _field(steps), torch.randn(3, 16, 8, generator=torch.Generator().manual_seed(1))
    want, _ = nvlabs_nft_dpm2_sampling(v_fn, x, torch.from_numpy(sigmas))
    got = _run(Solver("dpm2", sigmas, "ode"), v_fn, x, sigmas)
    # a few float32 roundings per step on values of size ~|x|, over `steps` steps
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0,
                               atol=8 * steps * np.finfo(np.float32).eps * float(want.abs().max()))


def test_dpm2_coefficients_are_first_order_at_both_ends_and_from_sigma_one():
    sigmas = sigma_schedule(SHIFTED, 6, 16)
    rows = dpm2_coefficients(sigmas)
    assert sigmas[0] == 1 and sigmas[-1] == 0
    assert rows[0, 2] == 0 and rows[1, 2] == 0 and rows[-1, 2] == 0  # step 1 starts from lambda(1) = -inf
    assert np.all(rows[2:-1, 2] != 0)
    np.testing.assert_allclose(rows[-1], [0, 1, 0])  # the last step lands on the data prediction


def _gaussian_flow(mu: float, std: float):
    """Data N(mu, std^2) per element: the exact velocity field E[eps - x0 | x_sigma] of x_sigma = (1 - sigma) x0 +
    sigma eps, and its ODE's exact solution from sigma 1 to 0, x0 = mu + std x1."""
    def v_fn(x, sigma):
        a = 1 - float(sigma)
        x0 = mu + a * std ** 2 / (a ** 2 * std ** 2 + float(sigma) ** 2) * (x - a * mu)
        return (x - x0) / float(sigma)
    return v_fn, lambda x1: mu + std * x1


def _error(name: str, steps: int, config) -> float:
    v_fn, exact = _gaussian_flow(0.5, 2.0)
    x1 = torch.randn(2, 64, 1, generator=torch.Generator().manual_seed(3), dtype=torch.float64).float()
    sigmas = sigma_schedule(config, steps, 16)
    out = _run(Solver(name, sigmas, "ode"), v_fn, x1, sigmas)
    return float((out - exact(x1)).abs().max())


@pytest.mark.parametrize("config", [{"shift": 1.0}, SHIFTED])
def test_dpm2_converges_at_second_order_and_euler_at_first(config):
    """The error at sigma 0 as the steps double: Euler's halves; dpm2's falls by more than 3 (about 3.4 here, 4x
    asymptotically but for the first and last steps, whose width in lambda stays log 2 however many steps)."""
    dpm = [_error("dpm2", n, config) for n in (32, 64, 128)]
    euler = [_error("euler", n, config) for n in (32, 64, 128)]
    dpm_rates = [dpm[k] / dpm[k + 1] for k in range(2)]
    euler_rates = [euler[k] / euler[k + 1] for k in range(2)]
    assert all(3 < r < 4.5 for r in dpm_rates), (dpm, dpm_rates)  # order 2 (a first-order scheme: ~2)
    assert all(1.8 < r < 2.2 for r in euler_rates), (euler, euler_rates)  # order 1
    assert dpm[-1] < euler[-1] / 10


def test_euler_is_the_sde_step_unchanged():
    sigmas = sigma_schedule(SHIFTED, 4, 16)
    g = torch.Generator().manual_seed(0)
    x, v, noise = (torch.randn(2, 16, 8, generator=g) for _ in range(3))
    got, got_lp = Solver("euler", sigmas, "sde").step(x, v, 1, noise_level=0.7, noise=noise)
    want, want_lp, _, _ = sde_step(x, v, sigmas[1], sigmas[2], sigmas[1], sde_type="sde", noise_level=0.7,
                                   noise=noise)
    assert torch.equal(got, want) and torch.equal(got_lp, want_lp)


def test_unknown_solver_and_a_noisy_dpm2_without_windows_are_refused():
    assert solver_choice("dpm2") == "dpm2"
    with pytest.raises(ValueError, match=r"solver='heun'; choose one of \('euler', 'dpm2'\)"):
        Solver("heun", [1.0, 0.0], "ode")
    with pytest.raises(ValueError, match="solver 'dpm2' with sde_type 'cps' steps after each sample's SDE window: "
                                         "it needs window_ends"):
        Solver("dpm2", [1.0, 0.0], "cps")


FLASH_STEPS, FLASH_SIZE, FLASH_STARTS, FLASH_LEVEL = 10, 2, np.array([0, 3, 6, 7]), 0.7


def _flash_inputs():
    """A shifted 10-step schedule, 4 samples with windows of 2 steps starting at 0, 3, 6 and 7, the field, the initial
    latents and every step's noise."""
    sigmas = sigma_schedule(SHIFTED, FLASH_STEPS, 16)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(len(FLASH_STARTS), 16, 8, generator=g)
    noises = torch.randn(FLASH_STEPS, *x.shape, generator=g)
    return sigmas, _field(11), x, noises


def _sample(solver: Solver, v_fn, x, sigmas, noises):
    """Every step's latents (N + 1, B, ...) and log-probs (N, B) of `solver` from x, the windows' noise levels."""
    levels = torch.from_numpy(window_noise_levels(FLASH_STARTS, FLASH_SIZE, FLASH_STEPS, FLASH_LEVEL))
    latents, log_probs = [x], []
    for i in range(FLASH_STEPS):
        x, log_prob = solver.step(x, v_fn(x, sigmas[i]), i, noise_level=levels[:, i], noise=noises[i])
        latents.append(x)
        log_probs.append(log_prob)
    return torch.stack(latents), torch.stack(log_probs)


def test_flash_is_mixgrpo_flash_sampling_to_float32_rounding():
    """Each sample against MixGRPO's Flash sampler run on it alone with its window as the deterministic list:
    every step's latents and the window's log-probs."""
    sigmas, v_fn, x, noises = _flash_inputs()
    solver = Solver("dpm2", sigmas, "sde", window_ends=FLASH_STARTS + FLASH_SIZE)
    latents, log_probs = _sample(solver, v_fn, x, sigmas, noises)
    for b, start in enumerate(FLASH_STARTS):
        deterministic = [not start <= i < start + FLASH_SIZE for i in range(FLASH_STEPS)]
        _, want, want_lp = mixgrpo_flash_sampling(v_fn, x[b:b + 1], torch.from_numpy(sigmas), deterministic,
                                                  noises[:, b:b + 1], FLASH_LEVEL)
        want = torch.stack(want)[:, 0]
        # a few float32 roundings per step on values of size ~|x|, over the steps
        np.testing.assert_allclose(latents[:, b].numpy(), want.numpy(), rtol=0,
                                   atol=8 * FLASH_STEPS * np.finfo(np.float32).eps * float(want.abs().max()))
        window = slice(start, start + FLASH_SIZE)
        got_lp, ref_lp = log_probs[window, b], torch.stack(want_lp)[window, 0]
        # -(x' - mean)^2 / (2 std^2) with x' - mean = std noise: the latents' rounding over the step std, times |noise|
        step_std = FLASH_LEVEL * np.sqrt(sigmas[window] / (1 - np.where(sigmas[window] == 1, sigmas[1], sigmas[window]))
                                         * (sigmas[window] - sigmas[start + 1:start + FLASH_SIZE + 1]))
        tol = 8 * np.finfo(np.float32).eps * float(want.abs().max()) / step_std.min() * float(noises.abs().max())
        np.testing.assert_allclose(got_lp.numpy(), ref_lp.numpy(), rtol=0, atol=tol)


def test_flash_keeps_the_windows_steps_and_changes_only_the_steps_after():
    """Against 'euler' on the same inputs: the latents up to each window's end and its log-probs bit-equal (what the
    trainer recomputes is unchanged), every later step's latents different."""
    sigmas, v_fn, x, noises = _flash_inputs()
    ends = FLASH_STARTS + FLASH_SIZE
    flash, flash_lp = _sample(Solver("dpm2", sigmas, "sde", window_ends=ends), v_fn, x, sigmas, noises)
    euler, euler_lp = _sample(Solver("euler", sigmas, "sde"), v_fn, x, sigmas, noises)
    for b, (start, end) in enumerate(zip(FLASH_STARTS, ends)):
        assert torch.equal(flash[:end + 1, b], euler[:end + 1, b])
        assert torch.equal(flash_lp[start:end, b], euler_lp[start:end, b])
        assert not torch.any(flash_lp[end:, b])
        if end < FLASH_STEPS - 1:  # dpm2's last step alone is Euler's (both land on the data prediction)
            gaps = (flash[end + 1:, b] - euler[end + 1:, b]).flatten(1).abs().amax(1)
            assert torch.all(gaps > 1e-4 * float(euler[:, b].abs().max()))
