"""Algorithm parity of the samplers on CPU (float32): FlowGRPO's SDE step (the trainer's `jaxflow.algorithms.sde`:
log-prob, mean and the log-prob's gradient with respect to the velocity) against flow_grpo's
`sde_step_with_logprob`, MixGRPO's window schedule against its `GRPOTrainingStates`, and MixGRPO-Flash's rollout
sampler (`jaxflow_bridge.rollout.solver.Solver`, 'dpm2' after each SDE window) against its `run_sample_step`; the
transcriptions are tests/reference_transcriptions.py's. `jaxflow_bench.algorithm_parity` writes the figures."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxflow.algorithms import mixgrpo, sde
from jaxflow_bench.parity_differences import array_differences
from jaxflow_bridge.contract.schedule import sigma_schedule, window_noise_levels
from jaxflow_bridge.engines import families
from jaxflow_bridge.rollout.solver import Solver
from tests import reference_transcriptions as ref

STEP_SHAPE, STEP_INDICES, STEP_LEVEL = (4, 32, 16), np.array([0, 3, 5, 8]), 0.7  # step 0: sigma 1 (sigma_max's case)


def step_inputs(seed: int = 0) -> dict:
    """The default family's 10-step schedule at 1024 tokens, 4 samples at different steps: x, v, noise float32."""
    r = np.random.default_rng(seed)
    sigmas = sigma_schedule(families.spec(families.DEFAULT).SCHEDULER_CONFIG, 10, 1024)
    x, v, noise = (r.standard_normal(STEP_SHAPE).astype(np.float32) for _ in range(3))
    return {"x": x, "v": v, "noise": noise, "sigma": sigmas[STEP_INDICES], "sigma_next": sigmas[STEP_INDICES + 1],
            "sigma_max": sigmas[1]}


def sde_step_figures(seed: int = 0) -> dict:
    """{flowgrpo_{sde_type}_step_vs_flow_grpo: log_prob, mean and grad (d sum(log_prob) / d v) differences} of the
    project's step recomputing its own sample against flow_grpo's."""
    x, out = step_inputs(seed), {}
    for sde_type in ("sde", "cps"):
        kw = {"sde_type": sde_type, "noise_level": STEP_LEVEL}
        args = (x["x"], x["sigma"], x["sigma_next"], x["sigma_max"])
        prev = sde.sde_step(x["x"], x["v"], *args[1:], noise=x["noise"], **kw)[0]

        def log_prob(v):
            _, lp, mean, _ = sde.sde_step(args[0], v, *args[1:], prev_sample=prev, **kw)
            return jnp.sum(lp), (lp, mean)

        grad, (lp, mean) = jax.grad(log_prob, has_aux=True)(jnp.asarray(x["v"]))
        v = torch.tensor(x["v"], requires_grad=True)
        ref_lp, ref_mean = ref.flow_grpo_sde_step_log_prob(
            v, torch.tensor(x["x"]), torch.tensor(np.asarray(prev)), torch.tensor(x["sigma"]),
            torch.tensor(x["sigma_next"]), float(x["sigma_max"]), STEP_LEVEL, sde_type)
        ref_lp.sum().backward()
        out[f"flowgrpo_{sde_type}_step_vs_flow_grpo"] = {
            **array_differences("log_prob", lp, ref_lp.detach().numpy()),
            **array_differences("mean", mean, ref_mean.detach().numpy()),
            **array_differences("grad", grad, v.grad.numpy())}
    return out


# (num_steps, window size, interval, stride) settings of MixGRPO's progressive schedule (its recipe: 25, 4, 25, 1)
WINDOW_GRID = list(itertools.product((10, 25), (1, 2, 4), (1, 3, 25), (1, 2)))


def window_figures() -> dict:
    """{mixgrpo_window_vs_official: mismatched_starts, compared}: over 4 N I training steps of each setting, the
    steps where the official window is whole (elsewhere the project's differs on purpose: docs/numerics.md §12)."""
    mismatched = compared = 0
    for steps, size, interval, stride in WINDOW_GRID:
        states = ref.MixGRPOTrainingStates(interval, size, steps - 2, stride)
        for k in range(4 * steps * interval):
            window = states.window()
            if len(window) == size:
                start = mixgrpo.window_start(k, num_steps=steps, size=size, window_range=(0, steps),
                                             interval=interval, stride=stride)
                mismatched += list(range(start, start + size)) != window
                compared += 1
            states.update()
    return {"mixgrpo_window_vs_official": {"mismatched_starts": mismatched, "compared": compared}}


FLASH_STEPS, FLASH_SIZE, FLASH_STARTS, FLASH_LEVEL = 10, 2, np.array([0, 3, 6, 7]), 0.7
FLASH_SCHEDULE = {"shift": 3.0, "use_dynamic_shifting": False}


def flash_inputs(seed: int = 5) -> tuple:
    """A shifted 10-step schedule; 4 samples (windows of 2 steps starting at 0, 3, 6, 7): a seeded nonlinear
    velocity field v(x, sigma), the initial latents (4, 16, 8) and every step's noise."""
    sigmas = sigma_schedule(FLASH_SCHEDULE, FLASH_STEPS, 16)
    g = torch.Generator().manual_seed(seed)
    w, u = torch.randn(8, 8, generator=g) / 8 ** 0.5, torch.randn(8, generator=g)
    x = torch.randn(len(FLASH_STARTS), 16, 8, generator=g)
    noises = torch.randn(FLASH_STEPS, *x.shape, generator=g)
    return sigmas, (lambda z, sigma: torch.tanh(z @ w) + float(sigma) * u), x, noises


def flash_sample(sigmas, v_fn, x, noises):
    """Every step's latents (N + 1, B, ...) and log-probs (N, B) of the rollout's Flash solver."""
    solver = Solver("dpm2", sigmas, "sde", window_ends=FLASH_STARTS + FLASH_SIZE)
    levels = torch.from_numpy(window_noise_levels(FLASH_STARTS, FLASH_SIZE, FLASH_STEPS, FLASH_LEVEL))
    latents, log_probs = [x], []
    for i in range(FLASH_STEPS):
        x, log_prob = solver.step(x, v_fn(x, sigmas[i]), i, noise_level=levels[:, i], noise=noises[i])
        latents.append(x)
        log_probs.append(log_prob)
    return torch.stack(latents), torch.stack(log_probs)


def flash_figures() -> dict:
    """{mixgrpo_flash_sampler_vs_official: latents (every step) and log-prob (the window's steps) differences},
    each sample against the reference run on it alone with its window as the non-deterministic steps."""
    sigmas, v_fn, x, noises = flash_inputs()
    latents, log_probs = flash_sample(sigmas, v_fn, x, noises)
    want, want_lp, got_lp = [], [], []
    for b, start in enumerate(FLASH_STARTS):
        deterministic = [not start <= i < start + FLASH_SIZE for i in range(FLASH_STEPS)]
        _, steps, lps = ref.mixgrpo_flash_sampling(v_fn, x[b:b + 1], torch.from_numpy(sigmas), deterministic,
                                                   noises[:, b:b + 1], FLASH_LEVEL)
        want.append(torch.stack(steps)[:, 0])
        want_lp.append(torch.stack(lps)[start:start + FLASH_SIZE, 0])
        got_lp.append(log_probs[start:start + FLASH_SIZE, b])
    return {"mixgrpo_flash_sampler_vs_official": {
        **array_differences("latents", latents.transpose(0, 1).numpy(), torch.stack(want).numpy()),
        **array_differences("log_prob", torch.stack(got_lp).numpy(), torch.stack(want_lp).numpy())}}


def figures() -> dict:
    """{comparison: differences} of the SDE step, MixGRPO's window schedule and its Flash sampler."""
    return {**sde_step_figures(), **window_figures(), **flash_figures()}
