"""Asynchronous reward scoring that never raises: a failing reward scores 0 and is counted."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import numpy as np

from jaxflow.rewards.multi import MultiReward

log = logging.getLogger(__name__)


class RewardPool:
    """Scores batches on worker threads so rewards overlap the next rollout.

    Each `submit` runs all rewards of one batch on one worker; up to `max_workers` batches run at
    once. The images must not be modified until the future resolves.
    """

    def __init__(self, reward: MultiReward, max_workers: int = 2):
        self.reward = reward
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="reward")

    def submit(self, images: np.ndarray, prompts: Sequence[str]) -> Future:
        """Future of {name: (B,) float32, "avg": (B,) float32, "errors": int}."""
        return self._executor.submit(self._score, images, list(prompts))

    def _score(self, images: np.ndarray, prompts: list[str]) -> dict:
        scores, errors = {}, 0
        for name in self.reward.names:
            try:
                scores[name] = self.reward.score_one(name, images, prompts)
            except Exception:
                log.exception("reward %r failed on a batch of %d; scoring it 0", name, len(prompts))
                scores[name] = np.zeros(len(prompts), dtype=np.float32)
                errors += 1
        out = self.reward.combine(scores)
        out["errors"] = errors
        return out

    def close(self) -> None:
        """Wait for submitted batches, then stop the workers."""
        self._executor.shutdown(wait=True)

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
