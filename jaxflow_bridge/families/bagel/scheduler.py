"""One BAGEL sample's denoising steps as the `scheduler` vLLM-Omni 0.20's `Bagel.generate_image` calls
(docs/bagel.md §7 (d)): `step(v, t, x, dt)` after each step's CFG combine, `.prev_sample` taken as the next latents.

It takes the contract's steps, not the engine's: sigma i -> i + 1 of `sigma_schedule` (the engine's own float32
timesteps are ignored), the sample's SDE window from its seed (`sample_windows`), `rollout/sde.py`'s step with its
noise level inside the window and none outside (or, with solver 'dpm2', `rollout/solver.py`'s second-order ODE
step), every draw from the sample's own generator in `BagelSamplingLoop`'s order (the initial latents first,
`initial`; then one noise tensor per step). So a sample has
the latents and log-probs that the loop gives it (tests/families/bagel/test_bagel_scheduler.py). It records the window's latents
and log-probs itself (`trajectory`); the engine's `return_trajectory_latents` can stay off. Never imports JAX or
vLLM.
"""
from __future__ import annotations

import types

import numpy as np
import torch

from jaxflow_bridge.contract.schedule import sample_windows, window_noise_levels, window_size
from jaxflow_bridge.rollout.solver import Solver


class WindowScheduler:
    """Built per sample: `sigmas` (N + 1,) of the request, the sample's `seed`, the request's window size, range,
    noise level, sde_type and solver, the latent shape (tokens, channels)."""

    def __init__(self, sigmas: np.ndarray, seed: int, *, window: int | None, window_range: tuple[int, int],
                 noise_level: float, sde_type: str, tokens: int, channels: int, solver: str):
        self.sigmas = np.asarray(sigmas, np.float32)
        steps = len(self.sigmas) - 1
        self.start = int(sample_windows(np.array([seed]), window, window_range, steps)[0])
        self.size = window_size(window, steps)
        self.solver = Solver(solver, self.sigmas, sde_type, window_ends=np.array([self.start + self.size]))
        self.levels = torch.from_numpy(window_noise_levels(np.array([self.start]), window, steps, noise_level)[0])
        self.generator = torch.Generator().manual_seed(int(seed))
        self.initial = torch.randn(tokens, channels, generator=self.generator)
        self.latents = torch.zeros(self.size + 1, tokens, channels)
        self.log_probs = torch.zeros(self.size)
        self.final: torch.Tensor | None = None
        self.index = 0

    def step(self, v: torch.Tensor, t, x: torch.Tensor, dt, **_) -> types.SimpleNamespace:
        """Step `index` of the contract's schedule from x (tokens, channels) with velocity v; `t` and `dt` (the
        engine's) are not used. log_prob None: the engine collects nothing, `trajectory` holds the window's."""
        i, steps = self.index, len(self.sigmas) - 1
        if i >= steps:
            raise RuntimeError(f"the engine asked for step {i + 1} of a {steps}-step schedule")
        noise = torch.randn(x.shape, generator=self.generator)
        slot, here = i - self.start, x.detach().float().cpu()
        if slot == 0:
            self.latents[0] = here
        out, log_prob = self.solver.step(here[None], v.detach().float().cpu()[None], i,
                                         noise_level=self.levels[i:i + 1], noise=noise[None])
        if 0 <= slot < self.size:
            self.latents[slot + 1], self.log_probs[slot] = out[0], log_prob[0]
        self.index += 1
        if self.index == steps:
            self.final = out[0]
        return types.SimpleNamespace(prev_sample=out[0].to(device=x.device, dtype=x.dtype), log_prob=None)

    def trajectory(self) -> dict[str, np.ndarray]:
        """After the last step: the window's latents (W + 1, tokens, channels), log-probs (W,), step indices and the
        final latents (tokens, channels)."""
        steps = len(self.sigmas) - 1
        if self.index != steps:
            raise RuntimeError(f"the sample took {self.index} of its {steps} steps")
        return {"latents": self.latents.numpy(), "log_probs": self.log_probs.numpy(),
                "step_index": (self.start + np.arange(self.size)).astype(np.int32), "final": self.final.numpy()}
