"""Traces of the real run: `profile.num_steps` steps of `python -m jaxflow.train`, from `profile.start_step` on
(steps counted 1..N like the logs), written by jax.profiler to `profile.dir` (default run_dir/profile) for
TensorBoard's profile plugin or Perfetto. The model's blocks name their regions (modulation, attention, mlp)."""
from __future__ import annotations

import logging
from pathlib import Path

import jax

log = logging.getLogger(__name__)


class StepProfiler:
    """`begin(step)` before a step and `end(step)` after it (1-based); `close()` stops a trace still open."""

    def __init__(self, start_step: int, num_steps: int, out_dir: str | Path):
        self.first, self.last, self.dir, self.active = start_step, start_step + num_steps - 1, Path(out_dir), False

    @classmethod
    def from_config(cls, cfg, run_dir: Path) -> StepProfiler:
        p = cfg.profile
        return cls(p.start_step, p.num_steps, p.dir or run_dir / "profile")

    def begin(self, step: int) -> None:
        if step == self.first and self.last >= self.first:
            jax.profiler.start_trace(str(self.dir))
            self.active = True

    def end(self, step: int, outputs=None) -> None:
        if self.active and step >= self.last:
            jax.block_until_ready(outputs)  # the traced steps' device work is inside the trace
            self.close()
            log.info("profile of steps %d-%d written to %s", self.first, self.last, self.dir)

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
