"""Sigma schedule and the FlowGRPO SDE / CPS / ODE step with log-prob, in JAX (DESIGN.md §4).

This is the spec. `bridge/rollout/sde.py` mirrors it line for line in torch, and tests/test_sde.py pins
the two together. All step math runs in float32 whatever the input dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

SDE_TYPES = ("sde", "cps", "ode")
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)

# The scheduler_config.json shipped with Qwen/Qwen-Image (qwen_image.md §3.4).
QWEN_IMAGE_SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "invert_sigmas": False,
    "stochastic_sampling": False,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
}

# FlowMatchEulerDiscreteScheduler's constructor defaults, for keys a config leaves out.
_SCHEDULER_DEFAULTS = {
    "shift": 1.0,
    "use_dynamic_shifting": False,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "shift_terminal": None,
    "time_shift_type": "exponential",
}
_UNSUPPORTED_FLAGS = ("invert_sigmas", "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas")


# ---------------------------------------------------------------------------------------------- schedule


def calculate_shift(image_seq_len, base_seq_len, max_seq_len, base_shift, max_shift) -> float:
    """Resolution-dependent shift mu: linear in the image token count, unclamped (as the diffusers pipelines)."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return float(image_seq_len * m + b)


def sigma_schedule(scheduler_config: dict, num_steps: int, image_seq_len: int) -> np.ndarray:
    """The (num_steps+1,) float32 sigmas of FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=linspace(1, 1/N, N), mu).

    Bitwise equal to diffusers: the same float32 numpy operations in the same order. The last sigma is 0.
    """
    cfg = {**_SCHEDULER_DEFAULTS, **scheduler_config}
    bad = [k for k in _UNSUPPORTED_FLAGS if cfg.get(k)]
    if bad:
        raise ValueError(f"sigma_schedule does not support scheduler options {bad}")
    if num_steps < 1 or (cfg["shift_terminal"] and num_steps < 2):
        raise ValueError(f"num_steps={num_steps} is too small for this scheduler config")

    s = np.linspace(1.0, 1.0 / num_steps, num_steps).astype(np.float32)
    if cfg["use_dynamic_shifting"]:
        mu = calculate_shift(
            int(image_seq_len),
            cfg["base_image_seq_len"],
            cfg["max_image_seq_len"],
            cfg["base_shift"],
            cfg["max_shift"],
        )
        s = _time_shift(cfg["time_shift_type"], mu, s)
    else:
        shift = cfg["shift"]
        s = shift * s / (1 + (shift - 1) * s)
    if cfg["shift_terminal"]:
        one_minus = 1 - s
        s = 1 - one_minus / (one_minus[-1] / (1 - cfg["shift_terminal"]))
    return np.concatenate([s, np.zeros(1, np.float32)]).astype(np.float32)


def _time_shift(kind: str, mu: float, s: np.ndarray) -> np.ndarray:
    """diffusers' time shift with its sigma exponent 1: exponential uses e^mu, linear uses mu."""
    if kind == "exponential":
        e = math.exp(mu)
        return e / (e + (1 / s - 1))
    if kind == "linear":
        return mu / (mu + (1 / s - 1))
    raise ValueError(f"time_shift_type must be 'exponential' or 'linear', got {kind!r}")


# ---------------------------------------------------------------------------------------------- step


def _per_sample(value, like):
    """A scalar or (B,) value as float32 (B, 1, ..., 1), broadcastable against `like`."""
    b = like.shape[0]
    value = jnp.broadcast_to(jnp.asarray(value, jnp.float32), (b,))
    return value.reshape((b,) + (1,) * (like.ndim - 1))


def _batch_mean(t):
    """Mean over all non-batch elements: (B, ...) -> (B,)."""
    return t.reshape(t.shape[0], -1).mean(axis=1)


def _sde_mean_std(x, v, sigma, sigma_next, sigma_max, a):
    """'sde': mean, std_dev_t (without sqrt(-dt)) and the step std std_dev_t * sqrt(-dt)."""
    dt = sigma_next - sigma
    sigma_t = jnp.where(sigma == 1, sigma_max, sigma)
    std = a * jnp.sqrt(sigma / (1 - sigma_t))
    mean = x * (1 + std**2 * dt / (2 * sigma)) + v * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
    return mean, std, std * jnp.sqrt(-dt)


def _cps_mean_std(x, v, sigma, sigma_next, a):
    """'cps': mean and std = sigma_next * sin(a pi / 2), which is also the step std."""
    std = sigma_next * jnp.sin(a * math.pi / 2)
    x0 = x - sigma * v
    x1 = x + (1 - sigma) * v
    mean = x0 * (1 - sigma_next) + x1 * jnp.sqrt(sigma_next**2 - std**2)
    return mean, std, std


def _log_prob(sde_type, prev_sample, mean, step_std):
    """Per-sample log-prob (B,) of prev_sample, averaged over elements; 0 where the step std is 0."""
    if sde_type == "ode":
        return jnp.zeros(mean.shape[0], jnp.float32)
    diff = jax.lax.stop_gradient(prev_sample) - mean
    noisy = step_std > 0
    if sde_type == "sde":
        s = jnp.where(noisy, step_std, 1.0)
        log_prob = -(diff**2) / (2 * s**2) - jnp.log(s) - _LOG_SQRT_2PI
    else:
        log_prob = -(diff**2)
    return jnp.where(noisy.reshape(-1), _batch_mean(log_prob), 0.0)


def sde_step(x, v, sigma, sigma_next, sigma_max, *, sde_type: str, noise_level, noise=None, prev_sample=None):
    """One step sigma -> sigma_next (dt < 0); returns (prev_sample, log_prob (B,), mean, std (B,)), all float32.

    x, v: (B, ...) latents and velocities. sigma, sigma_next, noise_level: scalar or (B,). sigma_max: the
    schedule's sigmas[1], which replaces sigma in the 'sde' std when sigma == 1. With prev_sample given, its
    log-prob is computed (gradient through mean only); otherwise prev_sample = mean + step_std * noise.
    std is flow_grpo's std_dev_t: without sqrt(-dt) for 'sde', the step std for 'cps', zeros for 'ode'.
    """
    if sde_type not in SDE_TYPES:
        raise ValueError(f"sde_type must be one of {SDE_TYPES}, got {sde_type!r}")
    if prev_sample is None and noise is None and sde_type != "ode":
        raise ValueError("sde_step needs noise (standard normal, like x) when prev_sample is not given")
    x = jnp.asarray(x, jnp.float32)
    v = jnp.asarray(v, jnp.float32)
    sigma = _per_sample(sigma, x)
    sigma_next = _per_sample(sigma_next, x)
    a = _per_sample(noise_level, x)

    if sde_type == "sde":
        mean, std, step_std = _sde_mean_std(x, v, sigma, sigma_next, _per_sample(sigma_max, x), a)
    elif sde_type == "cps":
        mean, std, step_std = _cps_mean_std(x, v, sigma, sigma_next, a)
    else:
        mean = x + v * (sigma_next - sigma)
        std = step_std = jnp.zeros_like(sigma)

    if prev_sample is not None:
        prev_sample = jnp.asarray(prev_sample, jnp.float32)
    elif sde_type == "ode":
        prev_sample = mean
    else:
        prev_sample = mean + step_std * jnp.asarray(noise, jnp.float32)
    log_prob = _log_prob(sde_type, prev_sample, mean, step_std)
    return prev_sample, log_prob, mean, std.reshape(x.shape[0])


def kl_term(mean, ref_mean, std):
    """Per-sample KL (B,): mean over non-batch elements of (mean - ref_mean)^2 / (2 std^2); 0 where std is 0."""
    mean = jnp.asarray(mean, jnp.float32)
    ref_mean = jnp.asarray(ref_mean, jnp.float32)
    std = _per_sample(std, mean)
    noisy = std > 0
    s = jnp.where(noisy, std, 1.0)
    return jnp.where(noisy.reshape(-1), _batch_mean((mean - ref_mean) ** 2 / (2 * s**2)), 0.0)


# Window helpers (numpy), line for line as in bridge/rollout/sde.py.
def window_size(size: int | None, num_steps: int) -> int:
    """The window length: `size`, or all steps but the schedule's last when size is 0 or None."""
    return int(size) if size else num_steps - 1


def sample_windows(seeds, size: int | None, window_range: tuple[int, int], num_steps: int) -> np.ndarray:
    """Per-sample window starts (B,) int32; the window of a sample is [start, start + window_size).

    start ~ uniform on [lo, hi - size] from numpy's Generator seeded by that sample's seed alone, with hi
    clipped to num_steps - 1 so that the schedule's last step is never in a window. size 0 or None: start 0
    (the window is every step but the last, window_range is ignored).
    """
    if num_steps < 2:
        raise ValueError(f"an SDE window needs num_steps >= 2, got {num_steps}")
    if not size:
        return np.zeros(len(seeds), np.int32)
    if size < 0 or size >= num_steps:
        raise ValueError(
            f"SDE window size {size} must be in [1, num_steps - 1 = {num_steps - 1}]: the last step is never trained"
        )
    lo, hi = window_range
    hi = min(hi, num_steps - 1)
    if lo < 0 or size > hi - lo:
        raise ValueError(
            f"SDE window size {size} does not fit in window_range {tuple(window_range)} "
            f"(clipped to [{lo}, {hi}) so that the last step {num_steps - 1} is excluded)"
        )
    starts = [np.random.default_rng(seed).integers(lo, hi - size, endpoint=True) for seed in seeds]
    return np.asarray(starts, np.int32)


def window_noise_levels(starts, size: int | None, num_steps: int, noise_level) -> np.ndarray:
    """(B, num_steps) float32 noise level per sample and step: noise_level (scalar or (B,)) inside the window, else 0."""
    starts = np.asarray(starts).reshape(-1, 1)
    steps = np.arange(num_steps)
    inside = (steps >= starts) & (steps < starts + window_size(size, num_steps))
    return np.where(inside, np.asarray(noise_level, np.float32).reshape(-1, 1), np.float32(0)).astype(np.float32)
