"""The reward-function contract: fn(images uint8 (B,H,W,3), prompts list[str]) -> float32 (B,).

A reward may also say how a batch can be scored in pieces on several workers (`split`): `splittable = True` when a
sample's score depends on that sample alone and the fn has no parallelism of its own (the OCR); `pieces()` when
it is a whole-batch step over such a fn (the shuffled control).

Conditioned rewards (image editing): a reward fn with `conditioned = True` is called
`fn(images, prompts, *, sources, targets)`: `sources` uint8 (B,H,W,3), each sample's reference image resized to its
output's size, and `targets` list[str | None], each sample's target text (the edit data's optional "target"). Its
`__call__` checks them with `check_sources`. Plain rewards keep the two-argument call.

Counted rewards (the VLM judges' refused replies): a reward fn with a `scored(images, prompts, **conditions)` method
returns (scores, counts {name: int}) for that batch alone; the reward pool reports each batch's counts. `score`
calls any reward fn the right way.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

RewardFn = Callable[[np.ndarray, Sequence[str]], np.ndarray]


def check_batch(images: np.ndarray, prompts: Sequence[str]) -> None:
    """Raise ValueError unless images is uint8 (B,H,W,3) with B == len(prompts)."""
    if not isinstance(images, np.ndarray) or images.dtype != np.uint8:
        raise ValueError(f"images must be a uint8 numpy array, got {type(images).__name__} "
                         f"{getattr(images, 'dtype', '')}")
    if images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"images must have shape (B, H, W, 3), got {images.shape}")
    if len(prompts) != images.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {len(prompts)} prompts")


def check_sources(images: np.ndarray, sources: np.ndarray, targets: Sequence[str | None]) -> None:
    """Raise ValueError unless a conditioned reward's `sources` are uint8 of the images' shape and `targets` has one
    entry (str or None) per image."""
    if not isinstance(sources, np.ndarray) or sources.dtype != np.uint8:
        raise ValueError(f"sources must be a uint8 numpy array, got {type(sources).__name__} "
                         f"{getattr(sources, 'dtype', '')}")
    if sources.shape != images.shape:
        raise ValueError(f"sources must have the images' shape {images.shape} (resized to the output size), "
                         f"got {sources.shape}")
    if len(targets) != images.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {len(targets)} targets")
    if not all(t is None or isinstance(t, str) for t in targets):
        raise ValueError(f"targets must be str or None, got {[type(t).__name__ for t in targets]}")


def score(fn, images: np.ndarray, prompts: Sequence[str], sources: np.ndarray | None = None,
          targets: Sequence[str | None] | None = None) -> tuple[np.ndarray, dict[str, int]]:
    """(scores, counts) of reward `fn` on a batch: `sources` and `targets` go to a conditioned fn only (ValueError
    when it gets none: its data must be an edit dataset); counts are {} unless fn is counted (`scored`)."""
    conditions = {}
    if getattr(fn, "conditioned", False):
        if sources is None or targets is None:
            raise ValueError("a conditioned reward (image editing) needs each sample's source image and target text: "
                             "train on an edit dataset ({\"image\", \"instruction\", \"target\"} rows)")
        conditions = {"sources": sources, "targets": list(targets)}
    if hasattr(fn, "scored"):
        scores, counts = fn.scored(images, prompts, **conditions)
        return scores, dict(counts)
    return fn(images, prompts, **conditions), {}


def check_scores(name: str, scores: np.ndarray, batch: int) -> np.ndarray:
    """Return scores as float32 (B,), raising ValueError on a wrong shape or non-finite value."""
    scores = np.asarray(scores, dtype=np.float32)
    if scores.shape != (batch,):
        raise ValueError(f"reward {name!r} returned shape {scores.shape}, expected ({batch},)")
    if not np.all(np.isfinite(scores)):
        raise ValueError(f"reward {name!r} returned non-finite scores: {scores}")
    return scores


def split(fn) -> tuple[RewardFn | None, Callable[[np.ndarray], np.ndarray] | None]:
    """(piece part, whole part) of a reward fn: the batch's scores are whole(concat(piece(p) for each piece p)).
    `fn.pieces()` when fn defines it; (fn, identity) when `fn.splittable`; (None, None) when fn must see the whole
    batch at once."""
    if hasattr(fn, "pieces"):
        return fn.pieces()
    if getattr(fn, "splittable", False):
        return fn, lambda scores: scores
    return None, None
