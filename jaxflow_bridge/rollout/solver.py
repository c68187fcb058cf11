"""The step a sampling loop takes (`Solver`), by the sampling params' solver (jaxflow_bridge/contract/solver.py):
'euler' is `sde.sde_step` (the window's SDE or CPS, the ODE elsewhere); 'dpm2' is DPM-Solver++(2M) carrying the
previous step's data prediction: with sde_type 'ode' at every step (DiffusionNFT), with 'sde' or 'cps' only after each
sample's SDE window, the steps up to the window's end being the sde_type's (MixGRPO-Flash, docs/numerics.md §12).
Float32 like the SDE step. Never imports JAX.
"""

from __future__ import annotations

import numpy as np
import torch

from jaxflow_bridge.contract.solver import dpm2_coefficients, solver_choice
from jaxflow_bridge.rollout.sde import sde_step


def check_solver(solver: str, sde_type: str, window_ends=None) -> None:
    """ValueError unless `solver` is known and a 'dpm2' rollout with an SDE (sde_type 'sde' or 'cps') is given each
    sample's window end (`window_ends`: where its dpm2 steps begin)."""
    solver_choice(solver)
    if solver == "dpm2" and sde_type != "ode" and window_ends is None:
        raise ValueError(f"solver 'dpm2' with sde_type {sde_type!r} steps after each sample's SDE window: "
                         f"it needs window_ends")


class Solver:
    """The steps of one schedule `sigmas` (N + 1,) for a batch; `step(x, v, i, ...)` is called for i = 0 .. N - 1 in
    order (dpm2 keeps the last data prediction, whichever step made it). `window_ends` (B,): each sample's first
    step after its SDE window, where 'dpm2' with sde_type 'sde' or 'cps' starts (ignored otherwise)."""

    def __init__(self, name: str, sigmas, sde_type: str, window_ends=None):
        check_solver(name, sde_type, window_ends)
        self.name, self.sde_type = name, sde_type
        self.sigmas = np.asarray(sigmas, np.float32)
        self.rows = dpm2_coefficients(self.sigmas) if name == "dpm2" else None
        self.ends = None if name == "euler" or sde_type == "ode" else torch.as_tensor(np.asarray(window_ends))
        self.previous: torch.Tensor | None = None

    def step(self, x, v, i: int, *, noise_level=0.0, noise=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x_{i+1}, its log-prob (B,)) from x_i (B, ...) and the velocity v at sigmas[i], float32; a dpm2 step's
        log-prob is 0 (no noise: nothing to train on)."""
        s = self.sigmas
        if self.rows is None:
            out, log_prob, _, _ = sde_step(x, v, s[i], s[i + 1], s[1], sde_type=self.sde_type,
                                           noise_level=noise_level, noise=noise)
            return out, log_prob
        x = torch.as_tensor(x).to(torch.float32)
        data = x - float(s[i]) * torch.as_tensor(v).to(device=x.device, dtype=torch.float32)
        a, b, c = (float(k) for k in self.rows[i])
        out = a * x + b * data
        if c:
            out = out + c * self.previous
        self.previous = data
        log_prob = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
        if self.ends is None:
            return out, log_prob
        before = (i < self.ends).to(x.device)
        if not bool(before.any()):
            return out, log_prob
        sde_out, sde_log_prob, _, _ = sde_step(x, v, s[i], s[i + 1], s[1], sde_type=self.sde_type,
                                               noise_level=noise_level, noise=noise)
        mask = before.reshape(-1, *([1] * (x.ndim - 1)))
        return torch.where(mask, sde_out, out), torch.where(before, sde_log_prob, log_prob)
