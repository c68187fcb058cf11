"""Edit-OCR: how well an edit wrote its target text, less how much it changed outside the text.

    score = edit_score(OCR(edited), target) - consistency * mean |edited - source| / 255 outside the text region

The OCR term is `OcrReward`'s (RapidOCR, the same confidence filter and normalised Levenshtein score) against the
sample's target text (the edit data's "target"), not a quoted prompt. The text region is the axis-aligned rectangle
around every line box the OCR engine detects in the source or in the edited image, grown by `margin` pixels: the old
word and the new one may differ in length, and whatever the edit writes as text counts as the edit. Everything
outside it should be left as it was; the mean absolute difference there (over pixels and channels, in [0, 1]) is
the consistency penalty, weighted by `consistency` (0: OCR alone). An image with no pixel outside the region pays
nothing. Scores lie in [-consistency, 1].
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxflow_bridge.rewards.base import check_batch, check_sources
from jaxflow_bridge.rewards.ocr import OcrReward
from jaxflow_bridge.rewards.text import edit_score


def text_region(boxes: Sequence[np.ndarray], shape: tuple[int, int], margin: int) -> np.ndarray:
    """(H, W) bool mask of the rectangle around all `boxes` ((4, 2) corner pixels (x, y)) grown by `margin`
    pixels, clipped to the image; all False without boxes."""
    mask = np.zeros(shape, bool)
    if not boxes:
        return mask
    corners = np.concatenate([np.asarray(b, np.float32).reshape(-1, 2) for b in boxes])
    x0, y0 = np.floor(corners.min(0)).astype(int) - margin
    x1, y1 = np.ceil(corners.max(0)).astype(int) + margin
    mask[max(y0, 0):max(y1 + 1, 0), max(x0, 0):max(x1 + 1, 0)] = True
    return mask


def outside_change(edited: np.ndarray, source: np.ndarray, region: np.ndarray) -> float:
    """Mean |edited - source| / 255 over the pixels outside `region` (and their channels); 0 when none is."""
    outside = ~region
    if not outside.any():
        return 0.0
    diff = np.abs(edited.astype(np.int16) - source.astype(np.int16))
    return float(diff[outside].mean() / 255.0)


class EditOcrReward:
    """`fn(images, prompts, *, sources, targets) -> (B,) float32` (a conditioned reward: rewards/base.py);
    `min_confidence` and `num_threads` as `OcrReward`'s. Per sample, as the OCR: the reward pool scores a batch in
    pieces; a source sign shared by several samples of a piece (a group's) is read once."""

    conditioned = True
    splittable = True

    def __init__(self, consistency: float = 1.0, margin: int = 2, min_confidence: float = 0.5,
                 num_threads: int = -1):
        if consistency < 0 or margin < 0:
            raise ValueError(f"edit_ocr consistency and margin must be >= 0, got {consistency}, {margin}")
        self.consistency, self.margin = float(consistency), int(margin)
        self.ocr = OcrReward(min_confidence=min_confidence, num_threads=num_threads)

    def score(self, edited: np.ndarray, source: np.ndarray, target: str,
              source_boxes: list[np.ndarray]) -> tuple[float, float]:
        """(OCR similarity to `target`, change outside the text region) of one edit; `source_boxes`: the line boxes
        the OCR detects in `source`."""
        lines = self.ocr.read_lines(edited)
        boxes = [box for box, _ in lines] + source_boxes
        region = text_region(boxes, edited.shape[:2], self.margin)
        text = "".join(t for _, t in lines)
        return edit_score(text, target), outside_change(edited, source, region)

    def __call__(self, images: np.ndarray, prompts: Sequence[str], *, sources: np.ndarray,
                 targets: Sequence[str | None]) -> np.ndarray:
        check_batch(images, prompts)
        check_sources(images, sources, targets)
        missing = [p for p, t in zip(prompts, targets) if t is None or not t.strip()]
        if missing:
            raise ValueError(f"edit_ocr needs each sample's target text (the edit data's \"target\"); "
                             f"none for {missing[:3]}")
        # a group's samples share their source sign: each distinct source is read once a call
        read: dict[bytes, list[np.ndarray]] = {}
        scores = []
        for edited, source, target in zip(images, sources, targets):
            key = np.ascontiguousarray(source).tobytes()
            if key not in read:
                read[key] = [box for box, _ in self.ocr.read_lines(source)]
            similarity, change = self.score(edited, source, target, read[key])
            scores.append(similarity - self.consistency * change)
        return np.asarray(scores, dtype=np.float32)
