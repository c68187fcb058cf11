"""Skipped updates over a run, and the run stopped when its policy diverged.

The train step skips an update (the state is left as it was, metric `skipped`) when its loss, its gradient or the
updated LoRA or optimizer state is not finite. A step with a skipped update is suspect: the LoRA it started from
gave a non-finite value, so it writes no checkpoint (the newest one, and those that orbax's `checkpoint.keep`
rotation would otherwise drop, stay as they were). More than `train.max_skipped_steps` such steps in a row stop the
run with `Diverged` (a streak from a fresh run's first update, before the policy moved, is named as no divergence);
so does a run that ends on such a step (its LoRA is not exported), and an adapter with a non-finite value at the
export. A rollout of the policy before any update (version 0) whose float arrays that the loss reads are not
finite stops the run at its step with `RolloutNotFinite`: the engine's output is broken, not the policy. The command
line prints either as one `error:` line, exit 1.
"""
from __future__ import annotations

from pathlib import Path

import jax
import numpy as np


class Diverged(RuntimeError):
    """The run stopped without writing its state: its policy diverged (a one-line message naming the fix)."""


class RolloutNotFinite(RuntimeError):
    """A step's rollout returned non-finite values the loss would read; no update ran on it (a one-line message)."""


def rollout_not_finite(step: int, bad: dict[str, int], rows: int, engine: str, quantization: str,
                       lora_apply: str) -> RolloutNotFinite:
    """Why the run stops at step `step` (counted as completed updates, as the metrics are): its rollout's fields
    `bad` (name -> rows of `rows` holding a NaN or an infinity) from `engine` with rollout.quantization
    `quantization`, serving the LoRA as `lora_apply`."""
    fields = "; ".join(f"{name}: {count} of {rows} rows" for name, count in bad.items())
    fix = ("try --config.rollout.quantization=none or check the engine's log" if quantization != "none" else
           "check the engine's log")
    return RolloutNotFinite(
        f"step {step}'s rollout returned non-finite values ({fields}) from the {engine} engine "
        f"(rollout.quantization={quantization}, LoRA served as {lora_apply}) serving the policy before any update: "
        f"the engine's output is broken, not the policy; no update ran on it and nothing of step {step} was "
        f"written; {fix}")


def check_finite(tree, what: str, directory: Path) -> None:
    """`Diverged` when a value of `tree` (a LoRA, `what`, about to be written to `directory`) is not finite."""
    bad = sum(int(np.size(x) - np.count_nonzero(np.isfinite(x))) for x in jax.tree.leaves(tree))
    if bad:
        raise Diverged(f"{what} holds {bad} non-finite values, so {directory} is not written: lower "
                       f"train.learning_rate and start again with --overwrite")


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


class SkipStreak:
    """The steps in a row, up to the newest, with a skipped update; `limit` is train.max_skipped_steps."""

    def __init__(self, limit: int):
        self.limit, self.first, self.last = limit, None, None

    def record(self, step: int, skipped: bool) -> None:
        """Step `step` (counted as completed updates) skipped an update or not."""
        if not skipped:
            self.first = self.last = None
            return
        self.first = step if self.first is None else self.first
        self.last = step

    @property
    def length(self) -> int:
        return 0 if self.first is None else self.last - self.first + 1

    @property
    def over(self) -> bool:
        """More steps in a row skipped than train.max_skipped_steps allows."""
        return self.length > self.limit

    def error(self, run_dir: Path, newest_checkpoint: int | None, ended: bool) -> Diverged:
        """Why the run stops here (`ended`: at its last step, on a skip) and what to do."""
        why = (f"the run ended on {_steps(self.first, self.last)}, whose updates were skipped" if ended else
               f"{_steps(self.first, self.last)} skipped updates, {self.length} in a row, more than "
               f"train.max_skipped_steps={self.limit}")
        kept = (f"the newest checkpoint, step {newest_checkpoint}, is as it was" if newest_checkpoint is not None
                else "no checkpoint was written")
        metrics = run_dir / "metrics.jsonl"
        if self.first == 1:  # a fresh run's first update: the policy had not moved yet
            return Diverged(f"{why} (a non-finite loss, gradient or updated LoRA) from the run's first update on, "
                            f"when the policy had not moved: look first at the batch (rewards, advantages) and the "
                            f"trainer's numerics, then at train.learning_rate; no lora_final is "
                            f"written and {kept}; see loss, grad_norm, reward_mean and logp_mismatch_* in {metrics}")
        return Diverged(f"{why} (a non-finite loss, gradient or updated LoRA): the policy diverged, so no lora_final "
                        f"is written and {kept}; see loss and grad_norm in {metrics}, then lower "
                        f"train.learning_rate and start again with --overwrite")
