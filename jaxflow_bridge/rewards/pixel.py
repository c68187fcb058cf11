"""Pixel-statistic rewards: cheap, dense signals a randomly initialised model can move (the tiny default).

- `brightness` = mean pixel value / 255, in [0, 1]: every pixel of every image carries signal, so group-normalised
  advantages have a consistent direction from the first step (unlike OCR, which scores the tiny model's noise 0).
- `midtone` = mean over pixels of 1 - |2 p / 255 - 1|, in [0, 1]: 1 for mid-grey, 0 for pure black or white. A
  gold reward that a brightness-trained policy ruins as it pushes pixels to white (the over-optimization demo).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxflow_bridge.rewards.base import check_batch


def brightness(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    """Mean pixel value over H, W and RGB, scaled to [0, 1]."""
    check_batch(images, prompts)
    return images.reshape(len(images), -1).mean(axis=1, dtype=np.float64).astype(np.float32) / 255.0


def midtone(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    """Mean over H, W and RGB of each pixel's closeness to mid-grey, 1 - |2 p / 255 - 1|, in [0, 1]."""
    check_batch(images, prompts)
    x = images.reshape(len(images), -1).astype(np.float64) / 127.5 - 1.0
    return (1.0 - np.abs(x)).mean(axis=1).astype(np.float32)
