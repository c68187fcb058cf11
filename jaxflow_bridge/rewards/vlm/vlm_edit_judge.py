"""The VLM judge of an edit: instruction following and consistency, rated 1-10 from the source and the edited image.

The judge's client sends one image a request (`VlmOcrReward`'s payload), and not every served VLM takes two, so the
pair goes as one image: the source on the left, the edit on the right, a grey bar between them (`side_by_side`);
the question says which is which. The reply is parsed as `VlmJudge`'s "score_10" (first number / 10, in [0, 1]).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxflow_bridge.rewards.base import check_batch, check_sources
from jaxflow_bridge.rewards.vlm.vlm_judge import VlmJudge

EDIT_TEMPLATE = ("The left half of this image is the original; the right half is the original edited by the "
                 "instruction \"{prompt}\". Rate from 1 to 10 how well the edit follows the instruction while "
                 "leaving everything the instruction does not mention unchanged. Answer with the number only.")
BAR = 4  # pixels of grey between the two halves


def side_by_side(sources: np.ndarray, images: np.ndarray) -> np.ndarray:
    """(B, H, 2W + BAR, 3) uint8: each source, a grey bar, its edited image."""
    bar = np.full((*images.shape[:2], BAR, 3), 128, np.uint8)
    return np.concatenate([sources, bar, images], axis=2)


class VlmEditJudge(VlmJudge):
    """`fn(images, prompts, *, sources, targets) -> (B,) float32` (a conditioned reward: rewards/base.py); the
    prompt is the edit instruction, the targets are not read. `template` (with "{prompt}") and `answer` as
    `VlmJudge`'s."""

    conditioned = True

    def __init__(self, base_url: str, model: str, *, template: str = EDIT_TEMPLATE, answer: str = "score_10",
                 **client):
        super().__init__(base_url, model, template=template, answer=answer, **client)

    def scored(self, images: np.ndarray, prompts: Sequence[str], *, sources: np.ndarray,
               targets: Sequence[str | None]) -> tuple[np.ndarray, dict[str, int]]:
        check_batch(images, prompts)
        check_sources(images, sources, targets)
        return super().scored(side_by_side(sources, images), prompts)

    def __call__(self, images: np.ndarray, prompts: Sequence[str], *, sources: np.ndarray,
                 targets: Sequence[str | None]) -> np.ndarray:
        return self.scored(images, prompts, sources=sources, targets=targets)[0]
