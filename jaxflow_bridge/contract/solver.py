"""The rollout's solvers (`sample.solver`, `eval.solver`; docs/numerics.md §10): 'euler', the SDE / CPS / ODE step of
`jaxflow_bridge/rollout/sde.py`, and 'dpm2', DiffusionNFT's deterministic second-order sampler: multistep
DPM-Solver++(2M) on the data prediction d = x - sigma v of the flow-matching velocity v. Its coefficients depend on
the schedule only (numpy, float64); `jaxflow_bridge/rollout/solver.py` applies them. Imports neither JAX nor torch.
"""

from __future__ import annotations

import numpy as np

SOLVERS = ("euler", "dpm2")


def solver_choice(value: str) -> str:
    """`value` if it names a solver (SOLVERS), else ValueError: the one check, made by the config's validation stage
    and the sampling loops."""
    if value not in SOLVERS:
        raise ValueError(f"solver={value!r}; choose one of {SOLVERS}")
    return value


def dpm2_coefficients(sigmas) -> np.ndarray:
    """(N, 3) float64 rows (a, b, c) of the N steps of `sigmas` (N + 1,): x_{i+1} = a x_i + b d_i + c d_{i-1}.

    With alpha = 1 - sigma and lambda = log(alpha / sigma): the first and the last step are first order (DDIM:
    a = s'/s, b = alpha' - s' alpha / s, c = 0 for s = sigmas[i], s' = sigmas[i + 1]); every other step is
    second order with h = lambda' - lambda_i, r = (lambda_i - lambda_{i-1}) / h, k = alpha' (1 - e^-h):
    a = s'/s, b = k (1 + 1/(2r)), c = -k/(2r). A step from sigma 1 (lambda = -inf) has r = inf, so c = 0 there."""
    s = np.asarray(sigmas, np.float64)
    n = len(s) - 1
    with np.errstate(divide="ignore"):
        lam = np.log1p(-s) - np.log(s)
    rows = np.zeros((n, 3))
    for i in range(n):
        here, nxt = s[i], s[i + 1]
        rows[i, 0] = nxt / here
        if i == 0 or i == n - 1:
            rows[i, 1] = (1 - nxt) - nxt * (1 - here) / here
            continue
        h = lam[i + 1] - lam[i]
        r = (lam[i] - lam[i - 1]) / h
        k = (1 - nxt) * -np.expm1(-h)
        rows[i, 1], rows[i, 2] = k * (1 + 0.5 / r), -0.5 * k / r
    return rows
