"""The numpy half of the numerics spec (docs/numerics.md §1), shared by the JAX step (`jaxflow/algorithms/sde.py`) and its torch
mirror (`jaxflow_bridge/rollout/sde.py`): the sigma schedule, bitwise equal to diffusers' FlowMatchEulerDiscreteScheduler,
and the per-sample SDE windows. Imports neither JAX nor torch.
"""

from __future__ import annotations

import math

import numpy as np

# The step a sample's window takes (docs/numerics.md §2-3), both step modules' choices (`sde_step`)
SDE_TYPES = ("sde", "cps", "ode")

# How a rollout runs true CFG's positive and negative rows (`jaxflow_bridge.rollout.sampling.SamplingLoop.cfg_forward`; the
# trainer's config names it `rollout.cfg_forward`): one forward each (the engines' default, the first), or one with the
# texts padded to one length.
CFG_FORWARDS = ("split", "batched")


def cfg_forward_choice(value: str) -> str:
    """`value` if it names a way to run true CFG's rows (CFG_FORWARDS), else ValueError: the one check, made by the
    config's validation stage and the diffusers engine."""
    if value not in CFG_FORWARDS:
        raise ValueError(f"cfg_forward={value!r}; choose one of {CFG_FORWARDS}")
    return value

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


def window_size(size: int | None, num_steps: int) -> int:
    """The window length: `size`, or all steps but the schedule's last when size is 0 or None."""
    return int(size) if size else num_steps - 1


def window_problem(size: int | None, window_range: tuple[int, int], num_steps: int) -> str | None:
    """Why SDE windows of `size` steps in `window_range` cannot be drawn on a schedule of `num_steps` steps (the
    rules of `sample_windows`), or None."""
    if num_steps < 2:
        return f"an SDE window needs num_steps >= 2, got {num_steps}"
    if not size:
        return None
    if size < 0 or size >= num_steps:
        return f"SDE window size {size} must be in [1, num_steps - 1 = {num_steps - 1}]: the last step is never trained"
    lo, hi = window_range
    hi = min(hi, num_steps - 1)
    if lo < 0 or size > hi - lo:
        return (f"SDE window size {size} does not fit in window_range {tuple(window_range)} "
                f"(clipped to [{lo}, {hi}) so that the last step {num_steps - 1} is excluded)")
    return None


def sample_windows(seeds, size: int | None, window_range: tuple[int, int], num_steps: int) -> np.ndarray:
    """Per-sample window starts (B,) int32; the window of a sample is [start, start + window_size).

    start ~ uniform on [lo, hi - size] from numpy's Generator seeded by that sample's seed alone, with hi
    clipped to num_steps - 1 so that the schedule's last step is never in a window. size 0 or None: start 0
    (the window is every step but the last, window_range is ignored). ValueError: `window_problem`'s.
    """
    problem = window_problem(size, window_range, num_steps)
    if problem:
        raise ValueError(problem)
    if not size:
        return np.zeros(len(seeds), np.int32)
    lo, hi = window_range[0], min(window_range[1], num_steps - 1)
    starts = [np.random.default_rng(seed).integers(lo, hi - size, endpoint=True) for seed in seeds]
    return np.asarray(starts, np.int32)


def window_noise_levels(starts, size: int | None, num_steps: int, noise_level) -> np.ndarray:
    """(B, num_steps) float32 noise level per sample and step: noise_level (scalar or (B,)) inside the window, else 0."""
    starts = np.asarray(starts).reshape(-1, 1)
    steps = np.arange(num_steps)
    inside = (steps >= starts) & (steps < starts + window_size(size, num_steps))
    return np.where(inside, np.asarray(noise_level, np.float32).reshape(-1, 1), np.float32(0)).astype(np.float32)
