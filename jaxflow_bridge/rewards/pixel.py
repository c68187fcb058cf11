"""Pixel-statistic rewards: cheap, dense signals a randomly initialised model can move (the tiny default).

- `brightness` = mean pixel value / 255, in [0, 1]: every pixel of every image carries signal, so group-normalised
  advantages have a consistent direction from the first step (unlike OCR, which scores the tiny model's noise 0).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxflow_bridge.rewards.base import check_batch


def brightness(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    """Mean pixel value over H, W and RGB, scaled to [0, 1]."""
    check_batch(images, prompts)
    return images.reshape(len(images), -1).mean(axis=1, dtype=np.float64).astype(np.float32) / 255.0
