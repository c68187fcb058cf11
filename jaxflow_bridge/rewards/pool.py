"""Asynchronous reward scoring that never raises: a failing reward scores 0 and is counted."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import numpy as np

from jaxflow_bridge.rewards.base import check_scores, score, split
from jaxflow_bridge.rewards.multi import MultiReward

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

    def submit(self, images: np.ndarray, prompts: Sequence[str], sources: np.ndarray | None = None,
               targets: Sequence[str | None] | None = None) -> Future:
        """Future of {name: (B,) float32, "avg": (B,) float32, "errors": int, "seconds": {name: worker seconds spent
        scoring the batch}, "counts": {name: {count: int}} of the counted rewards (base.py)}. `sources` (B,H,W,3)
        uint8 and `targets` (B,) reach the conditioned rewards only (an edit batch: each sample's reference image and
        target text)."""
        prompts = list(prompts)
        n = len(prompts)
        edges = np.linspace(0, n, max(1, min(self.max_workers, n)) + 1).astype(int).tolist()
        spans = list(zip(edges[:-1], edges[1:]))
        parts = {}
        for name in self.reward.names:
            fn = self.reward.rewards[name]
            piece, whole = split(fn)
            parts[name] = (piece, whole, spans) if piece is not None else (fn, lambda scores: scores, [(0, n)])
        conditions = (sources, None if targets is None else list(targets))
        batch = _Batch(self.reward, images, prompts, conditions, parts)
        for name, (_, _, name_spans) in parts.items():
            for index, span in enumerate(name_spans):
                self._executor.submit(batch.run, name, index, span)
        return batch.result

    def close(self) -> None:
        """Wait for submitted batches, then stop the workers."""
        self._executor.shutdown(wait=True)

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Batch:
    """One submitted batch. `parts[name]` = (piece fn, whole fn, spans): each task scores one span with the piece fn;
    the last task to finish joins each reward's spans and applies its whole fn. `conditions`: (sources, targets) of
    the batch, or Nones."""

    def __init__(self, reward: MultiReward, images: np.ndarray, prompts: list[str], conditions: tuple, parts: dict):
        self.reward, self.images, self.prompts, self.parts = reward, images, prompts, parts
        self.sources, self.targets = conditions
        self.result: Future = Future()
        self.pieces = {name: [None] * len(spans) for name, (_, _, spans) in parts.items()}
        self.remaining = sum(len(p) for p in self.pieces.values())
        self.failed: set[str] = set()
        self.seconds = dict.fromkeys(parts, 0.0)
        self.counts: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()

    def run(self, name: str, index: int, span: tuple[int, int]) -> None:
        a, b = span
        start = time.perf_counter()
        sources = None if self.sources is None else self.sources[a:b]
        targets = None if self.targets is None else self.targets[a:b]
        try:
            scores, counts = score(self.parts[name][0], self.images[a:b], self.prompts[a:b], sources, targets)
            self.pieces[name][index] = check_scores(name, scores, b - a)
            with self._lock:
                for key, value in counts.items():
                    mine = self.counts.setdefault(name, {})
                    mine[key] = mine.get(key, 0) + int(value)
        except Exception:
            log.exception("reward %r failed on samples %d:%d of a batch; scoring the batch 0", name, a, b)
            with self._lock:
                self.failed.add(name)
        with self._lock:
            self.seconds[name] += time.perf_counter() - start
            self.remaining -= 1
            last = self.remaining == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        try:
            out = self.reward.combine({name: self._joined(name) for name in self.reward.names})
            out["errors"], out["seconds"], out["counts"] = len(self.failed), dict(self.seconds), self.counts
            self.result.set_result(out)
        except Exception as e:  # a bug here must reach the caller, not vanish in a worker
            self.result.set_exception(e)

    def _joined(self, name: str) -> np.ndarray:
        """The reward's scores of the whole batch; zeros if any span (or the whole fn) failed."""
        if name not in self.failed:
            try:
                return check_scores(name, self.parts[name][1](np.concatenate(self.pieces[name])), len(self.prompts))
            except Exception:
                log.exception("reward %r failed on a batch of %d; scoring it 0", name, len(self.prompts))
                self.failed.add(name)
        return np.zeros(len(self.prompts), dtype=np.float32)
