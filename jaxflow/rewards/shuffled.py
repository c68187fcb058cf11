"""The control for learning proofs: another reward's scores, permuted across the batch at random.

A permutation keeps the batch's mean (the logged reward is still the true mean) but cuts the link between an image
and its score, so advantages carry no information about the image: a run trained on it must not improve the true
reward. Permutations come from one seeded generator per instance (calls serialised by a lock).
"""

from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from jaxflow.rewards.base import RewardFn, check_scores


class Shuffled:
    """`fn(images, prompts) -> inner(images, prompts)[permutation]`."""

    def __init__(self, inner: RewardFn, seed: int = 0):
        self.inner = inner
        self._rng, self._lock = np.random.default_rng(seed), threading.Lock()

    def __call__(self, images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
        scores = check_scores("shuffled", self.inner(images, prompts), len(images))
        with self._lock:
            order = self._rng.permutation(len(scores))
        return scores[order]
