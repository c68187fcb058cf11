"""Asynchronous reward scoring that never raises: a failing reward scores 0 and is counted."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np

from jaxflow.rewards.base import check_scores, split
from jaxflow.rewards.multi import MultiReward

log = logging.getLogger(__name__)


class RewardPool:
    """Scores batches on worker threads so rewards overlap the next rollout.

    A batch is cut into up to `max_workers` pieces for each reward that can be scored in pieces (`base.split`: the
    OCR), which the workers score at once; any other reward scores the whole batch on one worker. So the batch
    submitted last (the end of a rollout) waits for about 1/max_workers of its scoring, not all of it. Batches are
    served in submission order. The images must not be modified until the future resolves.
    """

    def __init__(self, reward: MultiReward, max_workers: int = 2):
        self.reward, self.max_workers = reward, max_workers
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="reward")

    def submit(self, images: np.ndarray, prompts: Sequence[str]) -> Future:
        """Future of {name: (B,) float32, "avg": (B,) float32, "errors": int}."""
        batch = _Batch(self.reward, images, list(prompts))
        edges = np.linspace(0, len(batch.prompts), max(1, min(self.max_workers, len(batch.prompts))) + 1).astype(int)
        tasks = []
        for name in self.reward.names:
            piece, whole = split(self.reward.rewards[name])
            if piece is None:
                tasks.append((name, None, None))
            else:
                batch.pieces[name] = [None] * (len(edges) - 1)
                batch.whole[name] = whole
                tasks += [(name, i, (int(a), int(b))) for i, (a, b) in enumerate(zip(edges[:-1], edges[1:]))]
        batch.remaining = len(tasks)
        for task in tasks:
            self._executor.submit(batch.run, *task)
        return batch.result

    def close(self) -> None:
        """Wait for submitted batches, then stop the workers."""
        self._executor.shutdown(wait=True)

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Batch:
    """One submitted batch: its tasks fill `scores` / `pieces`; the last task to finish assembles the result."""

    def __init__(self, reward: MultiReward, images: np.ndarray, prompts: list[str]):
        self.reward, self.images, self.prompts = reward, images, prompts
        self.result: Future = Future()
        self.scores: dict[str, np.ndarray] = {}
        self.pieces: dict[str, list] = {}
        self.whole: dict[str, Callable] = {}
        self.failed: set[str] = set()
        self.remaining = 0
        self._lock = threading.Lock()

    def run(self, name: str, index: int | None, bounds: tuple[int, int] | None) -> None:
        try:
            if index is None:
                self.scores[name] = self.reward.score_one(name, self.images, self.prompts)
            else:
                a, b = bounds
                piece, _ = split(self.reward.rewards[name])
                self.pieces[name][index] = check_scores(name, piece(self.images[a:b], self.prompts[a:b]), b - a)
        except Exception:
            log.exception("reward %r failed on a batch of %d; scoring it 0", name, len(self.prompts))
            with self._lock:
                self.failed.add(name)
        with self._lock:
            self.remaining -= 1
            last = self.remaining == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        try:
            scores = {}
            for name in self.reward.names:
                if name not in self.failed and name in self.pieces:
                    try:
                        scores[name] = check_scores(name, self.whole[name](np.concatenate(self.pieces[name])),
                                                    len(self.prompts))
                    except Exception:
                        log.exception("reward %r failed on a batch of %d; scoring it 0", name, len(self.prompts))
                        self.failed.add(name)
                if name in self.failed:
                    scores[name] = np.zeros(len(self.prompts), dtype=np.float32)
                elif name not in scores:
                    scores[name] = self.scores[name]
            out = self.reward.combine(scores)
            out["errors"] = len(self.failed)
            self.result.set_result(out)
        except Exception as e:  # a bug here must reach the caller, not vanish in a worker
            self.result.set_exception(e)
