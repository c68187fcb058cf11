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

from jaxflow_bridge.rewards.base import check_batch
from jaxflow_bridge.rewards.text import edit_score, require_target

_LOCAL = threading.local()


def thread_engine(num_threads: int):
    """This thread's RapidOCR engine for `num_threads` (-1: onnxruntime default), built once per thread.

    One engine per thread (RapidOCR keeps per-call state on the detector object, so threads must not share one):
    the reward pool's workers then run OCR in parallel (onnxruntime releases the GIL) instead of queueing on one
    engine. Keyed by pid as well, so a forked child builds its own.
    """
    engines = getattr(_LOCAL, "engines", None)
    if engines is None:
        engines = _LOCAL.engines = {}
    key = (os.getpid(), num_threads)
    if key not in engines:
        from rapidocr_onnxruntime import RapidOCR

        engines[key] = RapidOCR(use_cls=False, text_score=0.0, det_limit_type="max",
                                intra_op_num_threads=num_threads)
    return engines[key]


class OcrReward:
    """`fn(images, prompts) -> (B,) float32` OCR edit-distance reward. `num_threads`: onnxruntime threads of each
    engine (one per reward worker thread: with reward.workers W on C cores, about C / W). Per sample: the reward pool
    scores a batch in pieces on its workers."""

    splittable = True

    def __init__(self, min_confidence: float = 0.5, num_threads: int = -1):
        self.min_confidence = min_confidence
        self.num_threads = num_threads

    def read_lines(self, image: np.ndarray) -> list[tuple[np.ndarray, str]]:
        """(box (4, 2) float32 corner pixels (x, y), text) of each line detected in an RGB uint8 image with
        confidence >= min_confidence, top-to-bottom."""
        bgr = np.ascontiguousarray(image[..., ::-1])
        result, _ = thread_engine(self.num_threads)(bgr)
        return [(np.asarray(box, np.float32), text) for box, text, conf in result or ()
                if float(conf) >= self.min_confidence]

    def read_text(self, image: np.ndarray) -> str:
        """Concatenated text of the lines detected in an RGB uint8 image (top-to-bottom)."""
        return "".join(text for _, text in self.read_lines(image))

    def __call__(self, images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
        check_batch(images, prompts)
        targets = [require_target(p) for p in prompts]
        scores = [edit_score(self.read_text(img), tgt) for img, tgt in zip(images, targets)]
        return np.asarray(scores, dtype=np.float32)
