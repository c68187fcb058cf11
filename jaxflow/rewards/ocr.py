"""OCR reward with RapidOCR (PP-OCRv4 ONNX models, CPU, no angle classifier).

Mirrors flow_grpo's PaddleOCR scorer: the recognised lines (confidence >= `min_confidence`;
PaddleOCR's default drop_score is 0.5) are concatenated and scored against the prompt's quoted
target with `edit_score`. Detection resizes like PaddleOCR's default (longest side capped at 960,
no upscaling) rather than RapidOCR's (shortest side raised to 736), which is also ~3x faster.
"""

from __future__ import annotations

import os
import threading
from typing import Sequence

import numpy as np

from jaxflow.rewards.base import check_batch
from jaxflow.rewards.text import edit_score, require_target

_ENGINES: dict[tuple[int, int], tuple[object, threading.Lock]] = {}
_ENGINES_LOCK = threading.Lock()


def _engine(num_threads: int) -> tuple[object, threading.Lock]:
    """The process's RapidOCR engine for `num_threads` (-1: onnxruntime default), built once.

    Keyed by pid so a forked child builds its own. The returned lock serialises calls: RapidOCR
    keeps per-call state on the detector object.
    """
    key = (os.getpid(), num_threads)
    with _ENGINES_LOCK:
        if key not in _ENGINES:
            from rapidocr_onnxruntime import RapidOCR

            engine = RapidOCR(use_cls=False, text_score=0.0, det_limit_type="max",
                              intra_op_num_threads=num_threads)
            _ENGINES[key] = (engine, threading.Lock())
        return _ENGINES[key]


class OcrReward:
    """`fn(images, prompts) -> (B,) float32` OCR edit-distance reward."""

    def __init__(self, min_confidence: float = 0.5, num_threads: int = -1):
        self.min_confidence = min_confidence
        self.num_threads = num_threads

    def read_text(self, image: np.ndarray) -> str:
        """Concatenated text of the lines detected in an RGB uint8 image (top-to-bottom)."""
        engine, lock = _engine(self.num_threads)
        bgr = np.ascontiguousarray(image[..., ::-1])
        with lock:
            result, _ = engine(bgr)
        if not result:
            return ""
        return "".join(text for _, text, conf in result if float(conf) >= self.min_confidence)

    def __call__(self, images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
        check_batch(images, prompts)
        targets = [require_target(p) for p in prompts]
        scores = [edit_score(self.read_text(img), tgt) for img, tgt in zip(images, targets)]
        return np.asarray(scores, dtype=np.float32)
