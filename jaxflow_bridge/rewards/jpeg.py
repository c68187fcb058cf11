"""JPEG-size rewards (flow_grpo `jpeg_compressibility` / `jpeg_incompressibility`).

Size is the JPEG (quality 95) file size in kB (1 kB = 1000 bytes), as in flow_grpo:
- `jpeg_compressibility`   = -size_kB / 500   (smaller files score higher)
- `jpeg_incompressibility` = +size_kB         (unscaled, exactly as flow_grpo; it is the negation of
  compressibility up to the factor 500, which group-normalised advantages remove)
"""

from __future__ import annotations

import io
from typing import Sequence

import numpy as np
from PIL import Image

from jaxflow_bridge.rewards.base import check_batch

JPEG_QUALITY = 95


def jpeg_sizes_kb(images: np.ndarray) -> np.ndarray:
    """JPEG (quality 95) size of each image in kB, float32 (B,)."""
    sizes = []
    for image in images:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="JPEG", quality=JPEG_QUALITY)
        sizes.append(buffer.tell() / 1000.0)
    return np.asarray(sizes, dtype=np.float32)


def jpeg_compressibility(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    """-size_kB / 500."""
    check_batch(images, prompts)
    return -jpeg_sizes_kb(images) / 500.0


def jpeg_incompressibility(images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
    """+size_kB (flow_grpo scale)."""
    check_batch(images, prompts)
    return jpeg_sizes_kb(images)
