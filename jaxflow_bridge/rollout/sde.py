"""The FlowGRPO SDE / CPS / ODE step with log-prob in torch (docs/numerics.md §2-3); schedule and windows re-exported
from jaxflow_bridge/contract/schedule.py.

A line-for-line mirror of `jaxflow/algorithms/sde.py` (the spec) for the rollout; tests/algorithms/test_sde.py pins the two
together. All step math runs in float32 whatever the input dtype. Never imports JAX.
"""

from __future__ import annotations

import math

import torch

from jaxflow_bridge.contract.schedule import SDE_TYPES
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def _per_sample(value, like):
    """A scalar or (B,) value as float32 (B, 1, ..., 1), broadcastable against `like`."""
    b = like.shape[0]
    value = torch.as_tensor(value, dtype=torch.float32, device=like.device).expand(b)
    return value.reshape((b,) + (1,) * (like.ndim - 1))


def _batch_mean(t):
    """Mean over all non-batch elements: (B, ...) -> (B,)."""
    return t.reshape(t.shape[0], -1).mean(dim=1)


def _sde_mean_std(x, v, sigma, sigma_next, sigma_max, a):
    """'sde': mean, std_dev_t (without sqrt(-dt)) and the step std std_dev_t * sqrt(-dt)."""
    dt = sigma_next - sigma
    sigma_t = torch.where(sigma == 1, sigma_max, sigma)
    std = a * torch.sqrt(sigma / (1 - sigma_t))
    mean = x * (1 + std**2 * dt / (2 * sigma)) + v * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
    return mean, std, std * torch.sqrt(-dt)


def _cps_mean_std(x, v, sigma, sigma_next, a):
    """'cps': mean and std = sigma_next * sin(a pi / 2), which is also the step std."""
    std = sigma_next * torch.sin(a * math.pi / 2)
    x0 = x - sigma * v
    x1 = x + (1 - sigma) * v
    mean = x0 * (1 - sigma_next) + x1 * torch.sqrt(sigma_next**2 - std**2)
    return mean, std, std


def _log_prob(sde_type, prev_sample, mean, step_std):
    """Per-sample log-prob (B,) of prev_sample, averaged over elements; 0 where the step std is 0."""
    if sde_type == "ode":
        return torch.zeros(mean.shape[0], dtype=torch.float32, device=mean.device)
    diff = prev_sample.detach() - mean
    noisy = step_std > 0
    if sde_type == "sde":
        s = torch.where(noisy, step_std, torch.ones_like(step_std))
        log_prob = -(diff**2) / (2 * s**2) - torch.log(s) - _LOG_SQRT_2PI
    else:
        log_prob = -(diff**2)
    return torch.where(noisy.reshape(-1), _batch_mean(log_prob), 0.0)


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
    x = torch.as_tensor(x).to(torch.float32)
    v = torch.as_tensor(v).to(device=x.device, dtype=torch.float32)
    sigma = _per_sample(sigma, x)
    sigma_next = _per_sample(sigma_next, x)
    a = _per_sample(noise_level, x)

    if sde_type == "sde":
        mean, std, step_std = _sde_mean_std(x, v, sigma, sigma_next, _per_sample(sigma_max, x), a)
    elif sde_type == "cps":
        mean, std, step_std = _cps_mean_std(x, v, sigma, sigma_next, a)
    else:
        mean = x + v * (sigma_next - sigma)
        std = step_std = torch.zeros_like(sigma)

    if prev_sample is not None:
        prev_sample = torch.as_tensor(prev_sample).to(device=x.device, dtype=torch.float32)
    elif sde_type == "ode":
        prev_sample = mean
    else:
        prev_sample = mean + step_std * torch.as_tensor(noise).to(device=x.device, dtype=torch.float32)
    log_prob = _log_prob(sde_type, prev_sample, mean, step_std)
    return prev_sample, log_prob, mean, std.reshape(x.shape[0])


def kl_term(mean, ref_mean, std):
    """Per-sample KL (B,): mean over non-batch elements of (mean - ref_mean)^2 / (2 std^2); 0 where std is 0."""
    mean = torch.as_tensor(mean).to(torch.float32)
    ref_mean = torch.as_tensor(ref_mean).to(device=mean.device, dtype=torch.float32)
    std = _per_sample(std, mean)
    noisy = std > 0
    s = torch.where(noisy, std, torch.ones_like(std))
    return torch.where(noisy.reshape(-1), _batch_mean((mean - ref_mean) ** 2 / (2 * s**2)), 0.0)
