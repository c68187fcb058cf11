"""The step a sampling loop takes (`Solver`), by the sampling params' solver (jaxflow_bridge/contract/solver.py):
'euler' is `sde.sde_step` (the window's SDE or CPS, the ODE elsewhere); 'dpm2' is DPM-Solver++(2M), deterministic
(sde_type 'ode' only), carrying the previous step's data prediction. Float32 like the SDE step. Never imports JAX.
"""

from __future__ import annotations

import numpy as np
import torch

from jaxflow_bridge.contract.solver import dpm2_coefficients, solver_choice
from jaxflow_bridge.rollout.sde import sde_step


def check_solver(solver: str, sde_type: str) -> None:
    """ValueError unless `solver` is known and, for 'dpm2', the rollout is deterministic (sde_type 'ode')."""
    solver_choice(solver)
    if solver == "dpm2" and sde_type != "ode":
        raise ValueError(f"solver 'dpm2' is deterministic: it needs sde_type 'ode', got {sde_type!r}")


class Solver:
    """The steps of one schedule `sigmas` (N + 1,) for a batch; `step(x, v, i, ...)` is called for i = 0 .. N - 1 in
    order (dpm2 keeps the last data prediction)."""

    def __init__(self, name: str, sigmas, sde_type: str):
        check_solver(name, sde_type)
        self.name, self.sde_type = name, sde_type
        self.sigmas = np.asarray(sigmas, np.float32)
        self.rows = dpm2_coefficients(self.sigmas) if name == "dpm2" else None
        self.previous: torch.Tensor | None = None

    def step(self, x, v, i: int, *, noise_level=0.0, noise=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x_{i+1}, its log-prob (B,)) from x_i (B, ...) and the velocity v at sigmas[i], float32; dpm2's
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
        return out, torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
