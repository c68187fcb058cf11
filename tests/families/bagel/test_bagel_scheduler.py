"""jaxflow_bridge/families/bagel/scheduler.py: one sample's steps through `WindowScheduler.step`, called as vLLM-Omni's
`Bagel.generate_image` calls its scheduler (one call a step after the CFG combine, the engine's own shifted
timesteps and dt passed and ignored), give the sample the latents, log-probs, window and final latents that
`BagelSamplingLoop` gives it: the same bytes, as both run the same float32 operations on the same draws."""
import dataclasses

import numpy as np
import pytest
import torch

from jaxflow.families.bagel.config import TINY
from jaxflow_bridge.families.bagel.sampling import PIXELS_PER_TOKEN, SCHEDULER_CONFIG, BagelSamplingLoop, pad_ids
from jaxflow_bridge.contract.schedule import sigma_schedule
from jaxflow_bridge.families.bagel.scheduler import WindowScheduler
from jaxflow_bridge.families.bagel.model import BagelTorch
from tests import bagel_ref
from tests.bagel_helpers import SP

PROMPT, SEED = [5, 17, 240, 3, 99], 21


def engine_timesteps(num_timesteps: int, shift: float = 3.0):
    """generate_image's (t, dt) per step: linspace(1, 0, num_timesteps) shifted, the last dropped (its reading)."""
    t = torch.linspace(1, 0, num_timesteps)
    t = shift * t / (1 + (shift - 1) * t)
    return t[:-1], t[:-1] - t[1:]


@pytest.fixture(scope="module")
def loop():
    model = BagelTorch(**dataclasses.asdict(TINY))
    model.load_checkpoint(bagel_ref.weights(TINY))
    return BagelSamplingLoop(model)


@pytest.mark.parametrize("sp", [SP, dataclasses.replace(SP, sde_type="cps", noise_level=0.5, sde_window_size=3,
                                                        sde_window_range=(0, 4)),
                                dataclasses.replace(SP, sde_type="ode", solver="dpm2")], ids=["sde", "cps_w3", "dpm2"])
def test_the_scheduler_driven_steps_are_the_loops(loop, sp):
    want = loop.generate([PROMPT], 1, sp, seeds=[SEED])
    grid = (sp.height // PIXELS_PER_TOKEN, sp.width // PIXELS_PER_TOKEN)
    sigmas = sigma_schedule(SCHEDULER_CONFIG, sp.num_inference_steps, grid[0] * grid[1])
    sched = WindowScheduler(sigmas, SEED, window=sp.sde_window_size, window_range=sp.sde_window_range,
                            noise_level=sp.noise_level, sde_type=sp.sde_type, solver=sp.solver,
                            tokens=grid[0] * grid[1], channels=loop.model.latent_dim)
    ids, mask = pad_ids([PROMPT])
    contexts = (loop.model.prefill(ids, mask), loop.model.prefill(ids.new_zeros(1, 0), mask.new_zeros(1, 0)))
    x = sched.initial
    ts, dts = engine_timesteps(sp.num_inference_steps + 1)
    with torch.inference_mode():
        for i in range(sp.num_inference_steps):
            v = loop.velocity(x[None], sigmas[i], contexts, grid, sp)[0]
            x = sched.step(v, ts[i], x, dts[i]).prev_sample
    got = sched.trajectory()
    np.testing.assert_array_equal(got["step_index"], want.step_index[0])
    np.testing.assert_array_equal(got["latents"], want.latents[0])
    np.testing.assert_array_equal(got["log_probs"], want.log_probs[0])
    # the final latents are the engine's next x and decode to the loop's image
    np.testing.assert_array_equal(got["final"], x.numpy())
    np.testing.assert_array_equal(loop.decode(x[None], grid), want.images)


def test_a_step_past_the_schedule_and_an_early_trajectory_are_refused():
    sigmas = sigma_schedule(SCHEDULER_CONFIG, 2, 4)
    sched = WindowScheduler(sigmas, 0, window=1, window_range=(0, 1), noise_level=0.7, sde_type="sde", tokens=4,
                            channels=2, solver="euler")
    x = sched.initial
    with pytest.raises(RuntimeError, match="took 0 of its 2 steps"):
        sched.trajectory()
    for _ in range(2):
        x = sched.step(torch.zeros_like(x), 0.0, x, 0.0).prev_sample
    with pytest.raises(RuntimeError, match="step 3 of a 2-step schedule"):
        sched.step(torch.zeros_like(x), 0.0, x, 0.0)
