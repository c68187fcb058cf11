"""The log-prob gate: a run stopped when the trainer's log-probs of the rollout's samples stop matching the engine's.

Each step measures |logp_trainer - logp_rollout| over the rows whose trainer log-prob comes from the policy that
sampled them (`mismatch_metrics`): the recompute pass's rows and the first update's (it runs on the pre-update
LoRA). Where the two sides agree this is rounding noise (bf16 well under 1e-3 at p99, float32 under 1e-6); a stale
LoRA sync, a dtype or a scheduler / CFG setting that differs between the engine and the trainer makes it large.
`train.logp_gate` bounds its p99; `train.logp_gate_steps` (k) steps in a row over the bound stop the run with
`GateTripped`, and so does a violation at the run's first step (the canary: a mismatch from the start is a setup
error, not noise). The command line prints it as one `error:` line, exit 1; the checkpoints already written stay.
"""
from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

KEYS = ("logp_mismatch_p50", "logp_mismatch_p99", "logp_mismatch_max", "logp_mismatch_rows")


class GateTripped(RuntimeError):
    """The run stopped: its trainer's log-probs of the rollout's samples differ from the engine's (one line)."""


def mismatch_metrics(gaps) -> dict:
    """p50, p99, max and count of the values of `gaps` (|logp_trainer - logp_rollout|, NaN where a row or window
    step is not measured); the statistics are NaN where none is."""
    flat = jnp.ravel(gaps).astype(jnp.float32)
    return {"logp_mismatch_p50": jnp.nanpercentile(flat, 50), "logp_mismatch_p99": jnp.nanpercentile(flat, 99),
            "logp_mismatch_max": jnp.nanmax(flat), "logp_mismatch_rows": jnp.sum(~jnp.isnan(flat))}


class Gate:
    """The steps in a row, up to the newest, whose p99 mismatch passed `bound`; `steps` = k (0 or None: off)."""

    def __init__(self, bound: float, steps: int | None, first_step: int):
        self.bound, self.steps, self.first_step = bound, steps or 0, first_step
        self.streak, self.tripped_at = [], None

    def record(self, step: int, metrics: dict) -> None:
        """Step `step` (counted as completed updates) with its metrics; a step that measured no row (another
        algorithm, every row dropped) leaves the streak as it was."""
        if not self.steps or not metrics.get("logp_mismatch_rows"):
            return
        p99 = float(metrics["logp_mismatch_p99"])
        if p99 <= self.bound:
            self.streak = []
            return
        self.streak.append((step, p99, float(metrics["logp_mismatch_p50"]), float(metrics["logp_mismatch_max"])))
        canary = step == self.first_step
        if canary or len(self.streak) >= self.steps:
            self.tripped_at = "canary" if canary else "streak"

    @property
    def tripped(self) -> bool:
        return self.tripped_at is not None

    def error(self, run_dir: Path, newest_checkpoint: int | None) -> GateTripped:
        """Why the run stops, with the step's figures and the likely causes."""
        step, p99, p50, top = self.streak[-1]
        where = (f"step {step}, the run's first (the canary)" if self.tripped_at == "canary" else
                 f"{len(self.streak)} steps in a row ({self.streak[0][0]}-{step}), train.logp_gate_steps={self.steps}")
        kept = (f"the newest checkpoint, step {newest_checkpoint}, is as it was" if newest_checkpoint is not None
                else "no checkpoint was written")
        return GateTripped(
            f"log-prob gate: |trainer - rollout| log-prob p99 {p99:.3g} > train.logp_gate={self.bound:g} at {where} "
            f"(p50 {p50:.3g}, max {top:.3g}): the trainer does not score the samples as the engine drew them; likely "
            f"a stale LoRA sync, a dtype mismatch, or a scheduler (noise_level, sde_type) or CFG setting that differs "
            f"between engine and trainer; {kept}; see logp_mismatch_* in {run_dir / 'metrics.jsonl'} "
            f"(train.logp_gate_steps=0 turns the gate off)")
