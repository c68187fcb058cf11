"""A VLM judge behind an OpenAI-compatible server: one question per image about its prompt, the reply parsed to a
score in [0, 1] (the same client, retries and health check as `VlmOcrReward`).

Tasks (`task`, or your own `template` with `{prompt}` and `answer`):
- "geneval": "Does this image show {prompt}?": yes -> 1, anything else -> 0 (GenEval-style prompts name the
  objects, counts, colours and positions to check).
- "quality": a 1-10 rating of how well the image matches the prompt and how good it looks: the first number of the
  reply / 10, clipped to [0, 1].
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np

from jaxflow_bridge.rewards.base import check_batch
from jaxflow_bridge.rewards.vlm_ocr import VlmOcrReward

TASKS = {
    "geneval": ("Does this image show {prompt}? Check every object, count, colour and position it names. "
                "Answer only yes or no.", "yes_no"),
    "quality": ("Rate from 1 to 10 how well this image matches the description \"{prompt}\" and how good it looks. "
                "Answer with the number only.", "score_10"),
}
ANSWERS = ("yes_no", "score_10")


def parse(reply: str, answer: str) -> float:
    """The score of one reply: yes_no -> 1.0 if its first word is yes, else 0.0; score_10 -> its first number / 10
    clipped to [0, 1] (0.0 without a number)."""
    text = reply.strip().lower()
    if answer == "yes_no":
        return float(re.match(r"\W*yes\b", text) is not None)
    number = re.search(r"\d+(?:\.\d+)?", text)
    return 0.0 if number is None else float(min(max(float(number.group()) / 10.0, 0.0), 1.0))


class VlmJudge(VlmOcrReward):
    """`fn(images, prompts) -> (B,) float32`; `task` picks a question and answer format, or `template` ("{prompt}"
    is replaced by the sample's prompt) with `answer` in ANSWERS."""

    def __init__(self, base_url: str, model: str, *, task: str = "geneval", template: str | None = None,
                 answer: str | None = None, **client):
        if template is None:
            if task not in TASKS:
                raise ValueError(f"vlm_judge task {task!r}; choose one of {sorted(TASKS)} or pass a template")
            template, answer = TASKS[task][0], answer or TASKS[task][1]
        if "{prompt}" not in template:
            raise ValueError(f"vlm_judge template must contain {{prompt}}, got {template!r}")
        if answer not in ANSWERS:
            raise ValueError(f"vlm_judge answer {answer!r}; choose one of {ANSWERS}")
        self.template, self.answer = template, answer
        client.setdefault("temperature", 0.0)  # a judge should not sample its verdict
        super().__init__(base_url, model, **client)

    def __call__(self, images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
        check_batch(images, prompts)
        questions = [self.template.replace("{prompt}", p) for p in prompts]
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrency, len(images)))) as ex:
            replies = list(ex.map(self.read_text, images, questions))
        return np.asarray([parse(r, self.answer) for r in replies], dtype=np.float32)
