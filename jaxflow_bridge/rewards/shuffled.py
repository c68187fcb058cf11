"""The control for learning proofs: another reward's scores, permuted across the batch at random.

A permutation keeps the batch's mean (the logged reward is still the true mean) but cuts the link between an image
and its score, so advantages carry no information about the image: a run trained on it must not improve the true
reward. The inner reward scores each image against its own prompt (and, conditioned, its own source and target:
they travel with the image); only the scores are permuted. Permutations come from one seeded generator per instance
(calls serialised by a lock).
"""

from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from jaxflow_bridge.rewards.base import RewardFn, check_scores, split


class Shuffled:
    """`fn(images, prompts, **conditions) -> inner(images, prompts, **conditions)[permutation]`; conditioned when the
    inner reward is (base.py); the permutation spans the whole batch, also when the reward pool scores the inner
    reward in pieces (`pieces`)."""

    def __init__(self, inner: RewardFn, seed: int = 0):
        self.inner = inner
        self.conditioned = getattr(inner, "conditioned", False)
        self._rng, self._lock = np.random.default_rng(seed), threading.Lock()

    def __call__(self, images: np.ndarray, prompts: Sequence[str], **conditions) -> np.ndarray:
        return self.permute(check_scores("shuffled", self.inner(images, prompts, **conditions), len(images)))

    def permute(self, scores: np.ndarray) -> np.ndarray:
        """The batch's scores in a fresh random order."""
        with self._lock:
            order = self._rng.permutation(len(scores))
        return scores[order]

    def pieces(self):
        """(the inner reward's piece part, its whole part then the permutation); (None, None) if the inner reward
        must see the whole batch (base.split)."""
        piece, whole = split(self.inner)
        if piece is None:
            return None, None
        return piece, lambda scores: self.permute(whole(scores))
