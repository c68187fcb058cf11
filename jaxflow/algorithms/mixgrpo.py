"""MixGRPO (Li et al., arXiv 2507.21802; Tencent-Hunyuan/MixGRPO `fastvideo/utils/grpo_states.py`,
`fastvideo/train_grpo_flux.py`), docs/numerics.md §12: SDE steps only inside a window of the schedule, ODE steps
elsewhere, FlowGRPO's objective on the window's steps only; the window is the same for every sample of a step and
slides with training progress (its "progressive" strategy with prog_overlap and roll_back).

The project's per-sample SDE windows (sample.window_size, sample.window_range; `jaxflow_bridge.contract.schedule`)
carry it: for step k the rollout's window_range is narrowed to exactly [start_k, start_k + window_size), so every
sample's window starts at start_k; the train step then trains those steps as FlowGRPO does. Its Flash variant
(sample.solver 'dpm2') only changes the rollout's steps after the window, never the window's, so the train step is
the same."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxflow.algorithms.flowgrpo_step import FLOWGRPO, FlowGRPO


def window_start(step: int, *, num_steps: int, size: int, window_range: tuple[int, int], interval: int,
                 stride: int) -> int:
    """The window's first step at training step `step` (0-based), MixGRPO's cur_timestep: lo + stride * (step //
    interval), back to lo (roll_back) once it passes hi - 1 (hi clipped to num_steps - 1 as `schedule.sample_windows`
    clips it; the reference's max_timesteps = num_steps - 2 for window_range (0, num_steps)). Where the reference's
    window would be cut short by the end (even empty), the whole window ending at hi is taken instead."""
    lo, hi = window_range
    hi = min(hi, num_steps - 1)
    last = hi - size
    if last < lo:
        raise ValueError(f"a window of {size} steps does not fit window_range {tuple(window_range)} of {num_steps}")
    positions = (hi - 1 - lo) // stride + 1
    return min(lo + stride * ((step // interval) % positions), last)


@dataclasses.dataclass(frozen=True)
class MixGRPO(FlowGRPO):
    """FlowGRPO's objective on a sliding SDE window shared by the step's samples (`window_start`); with
    sample.solver 'dpm2' its Flash variant: DPM-Solver++(2M) after the window (the rollout's `Solver`)."""

    dpm2_after_window: ClassVar[bool] = True

    def rollout_sampling(self, params: dict, cfg, step: int) -> dict:
        """`params` (the family's sampling dict) with its window_range narrowed to step `step`'s window."""
        s, t = cfg.sample, cfg.train
        start = window_start(step, num_steps=s.num_steps, size=s.window_size, window_range=tuple(s.window_range),
                             interval=t.mixgrpo.interval, stride=t.mixgrpo.stride)
        return {**params, "sde_window_range": (start, start + s.window_size)}

    def rules(self, config, policy):
        return super().rules(config, policy) + (
            ("mixgrpo_interval", config.mixgrpo_interval < 1, "must be >= 1 (training steps between moves)"),
            ("mixgrpo_stride", config.mixgrpo_stride < 1, "must be >= 1 (steps a move)"))


MIXGRPO = MixGRPO("mixgrpo", "MixGRPO: FlowGRPO on a sliding SDE window, ODE elsewhere", fields=FLOWGRPO.fields,
                  config_keys=FLOWGRPO.config_keys + ("mixgrpo_interval", "mixgrpo_stride"))
