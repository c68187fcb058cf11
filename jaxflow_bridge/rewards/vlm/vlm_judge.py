"""A VLM judge behind an OpenAI-compatible server: one question per image about its prompt, the reply parsed to a
score in [0, 1] (the same client, retries and health check as `VlmOcrReward`).

Tasks (`task`, or your own `template` with `{prompt}` and `answer`):
- "geneval": "Does this image show {prompt}?": yes -> 1, no -> 0 (GenEval-style prompts name the objects, counts,
  colours and positions to check).
- "quality": a 1-10 rating of how well the image matches the prompt and how good it looks: the rating / 10.

The prompt contract (`parse`): a yes_no reply is judged by its first word that is "yes" or "no" ("Answer: yes" is
yes); a score_10 reply by "N/10" or "N out of 10" where it says so, else by its last number ("On a scale of 1 to 10:
8" is 8), which must lie in [1, 10]. A reply that fits neither (no verdict, "-3", "12") is refused: it scores 0, is
logged, and counted: in the judge's `refused` over its life, and per batch in `scored`'s counts (the run's
`reward/<name>/refused`).
"""

from __future__ import annotations

import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np

from jaxflow_bridge.rewards.base import check_batch
from jaxflow_bridge.rewards.vlm.vlm_ocr import VlmOcrReward

log = logging.getLogger(__name__)

TASKS = {
    "geneval": ("Does this image show {prompt}? Check every object, count, colour and position it names. "
                "Answer only yes or no.", "yes_no"),
    "quality": ("Rate from 1 to 10 how well this image matches the description \"{prompt}\" and how good it looks. "
                "Answer with the number only.", "score_10"),
}
ANSWERS = ("yes_no", "score_10")


def parse(reply: str, answer: str) -> float | None:
    """The score of one reply under the prompt contract above, None when the reply is refused."""
    text = reply.strip().lower()
    if answer == "yes_no":
        word = re.search(r"\b(yes|no)\b", text)
        return None if word is None else float(word.group(1) == "yes")
    number = r"[-+]?\d+(?:\.\d+)?"
    out_of = re.search(rf"({number})\s*(?:/|out of)\s*10\b", text)
    numbers = [out_of.group(1)] if out_of else re.findall(number, text)
    if not numbers:
        return None
    value = float(numbers[-1])
    return value / 10.0 if 1.0 <= value <= 10.0 else None


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
        self.refused, self.lock = 0, threading.Lock()  # replies outside the contract, over the judge's life
        client.setdefault("temperature", 0.0)  # a judge should not sample its verdict
        super().__init__(base_url, model, **client)

    def scored(self, images: np.ndarray, prompts: Sequence[str]) -> tuple[np.ndarray, dict[str, int]]:
        """(scores, {"refused": replies of this batch outside the contract}): a counted reward (base.py)."""
        check_batch(images, prompts)
        questions = [self.template.replace("{prompt}", p) for p in prompts]
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrency, len(images)))) as ex:
            replies = list(ex.map(self.read_text, images, questions))
        scores = [parse(r, self.answer) for r in replies]
        refused = [r for r, score in zip(replies, scores) if score is None]
        if refused:
            with self.lock:
                self.refused += len(refused)
            log.warning("vlm_judge refused %d of %d replies (scored 0), e.g. %r", len(refused), len(replies),
                        refused[0][:200])
        return (np.asarray([0.0 if score is None else score for score in scores], dtype=np.float32),
                {"refused": len(refused)})

    def __call__(self, images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
        return self.scored(images, prompts)[0]
