"""Prompt datasets (flow_grpo-style .txt or .jsonl) and deterministic group sampling."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from jaxflow_bridge.rewards.text import extract_target


@dataclass(frozen=True)
class PromptItem:
    prompt: str  # an edit dataset's instruction
    target: str | None  # the text to render (OCR tasks); None where the rewards need none
    image: str | None = None  # an edit dataset's reference image: its absolute path


def load_reference(path: str, height: int, width: int) -> np.ndarray:
    """An edit item's reference image as uint8 (1, height, width, 3), RGB, resized to the sample size: what the
    engine receives once per prompt group and the conditioned rewards score against."""
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB").resize((width, height), Image.BICUBIC), np.uint8)[None]


def _parse_txt(text: str, where: str, need_target: bool = True, base: str = ".") -> PromptItem:
    target = extract_target(text)
    if target is None and need_target:
        raise ValueError(f"{where}: no target text in double quotes: {text!r}; the OCR rewards score the text in "
                         f"the prompt's first \"...\" (e.g. A sign that says \"OPEN\")")
    return PromptItem(text, target)


def _parse_edit(row: dict, where: str, base: str) -> PromptItem:
    """An edit row: `image` (a path relative to the file), `instruction`, optional `target` text."""
    image, instruction, target = row.get("image"), row.get("instruction"), row.get("target")
    if not isinstance(instruction, str) or not instruction.strip():
        raise ValueError(f"{where}: an edit row (with 'image') needs a non-blank string 'instruction'")
    if target is not None and (not isinstance(target, str) or not target.strip()):
        raise ValueError(f"{where}: 'target' must be a non-blank string, got {target!r}")
    path = os.path.join(base, image) if isinstance(image, str) else None
    if path is None or not os.path.isfile(path):
        raise ValueError(f"{where}: 'image' {image!r} is no file (paths are relative to the dataset file)")
    return PromptItem(instruction, target, os.path.abspath(path))


def _parse_jsonl(text: str, where: str, need_target: bool = True, base: str = ".") -> PromptItem:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: invalid JSON: {err}") from err
    if isinstance(row, dict) and "image" in row:
        return _parse_edit(row, where, base)
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
        raise ValueError(f"{where}: expected an object with a string 'prompt'")
    target = row.get("target")
    if target is None:
        return _parse_txt(row["prompt"], where, need_target)
    if not isinstance(target, str) or not target.strip():
        raise ValueError(f"{where}: 'target' must be a non-blank string, got {target!r}")
    return PromptItem(row["prompt"], target)


_PARSERS = {".txt": _parse_txt, ".jsonl": _parse_jsonl}


def load_prompts(path: str | os.PathLike, need_target: bool = True) -> list[PromptItem]:
    """Read prompts from .txt (one per line, target in the first "...") or .jsonl
    ({"prompt": ..., "target": optional}, or an edit dataset's {"image": path relative to the file, "instruction":
    ..., "target": optional}). Blank lines are skipped; errors name file:line. With need_target (the
    OCR rewards) a prompt without a target is an error; without it (PickScore, ...) its target is None."""
    path = os.fspath(path)
    parse = _PARSERS.get(os.path.splitext(path)[1])
    if parse is None:
        raise ValueError(f"{path}: unknown prompt file extension; expected one of {sorted(_PARSERS)}: write the "
                         f"prompts one a line to a .txt, or as {{\"prompt\": ...}} rows to a .jsonl")
    items = []
    with open(path, encoding="utf-8") as f:
        try:
            for lineno, line in enumerate(f, start=1):
                text = line.strip()
                if text:
                    items.append(parse(text, f"{path}:{lineno}", need_target, os.path.dirname(path) or "."))
        except UnicodeDecodeError as err:
            raise ValueError(f"{path}: not UTF-8 text ({err.reason}): save the prompts as UTF-8") from None
    if not items:
        raise ValueError(f"{path}: no prompts (the file is empty or blank): write one prompt a line")
    return items


class GroupSampler:
    """Per-step prompt groups, a pure function of (seed, step).

    Prompts are visited epoch-wise without replacement: each epoch is a seeded permutation walked
    `prompts_per_step` at a time. A step that straddles an epoch boundary takes the next epoch's
    first prompts that are not already in the step (the epoch remains a permutation), so the
    prompts of a step are always distinct. Each prompt is repeated `group_size` times (members
    adjacent) and the flat list is cut into `num_hosts` contiguous, equal chunks.
    """

    def __init__(self, num_prompts: int, prompts_per_step: int, group_size: int, seed: int,
                 num_hosts: int = 1, host_index: int = 0):
        if not 1 <= prompts_per_step <= num_prompts:
            raise ValueError(f"prompts_per_step={prompts_per_step} must be in [1, num_prompts="
                             f"{num_prompts}]")
        if group_size < 1 or seed < 0:
            raise ValueError(f"need group_size >= 1 and seed >= 0, got {group_size}, {seed}")
        total = prompts_per_step * group_size
        if num_hosts < 1 or total % num_hosts:
            raise ValueError(f"prompts_per_step * group_size = {prompts_per_step} * {group_size} = "
                             f"{total} samples per step do not split evenly over {num_hosts} hosts")
        if not 0 <= host_index < num_hosts:
            raise ValueError(f"host_index={host_index} not in [0, {num_hosts})")
        self.num_prompts = num_prompts
        self.prompts_per_step = prompts_per_step
        self.group_size = group_size
        self.seed = seed
        self.num_hosts = num_hosts
        self.host_index = host_index
        self.step = 0
        self._cached: tuple[int, np.ndarray] | None = None

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)

    def _next_epoch_order(self, epoch: int, prev: np.ndarray) -> np.ndarray:
        """Order of `epoch` given the previous epoch's order (boundary de-duplication)."""
        perm = self._permutation(epoch)
        tail_len = (epoch * self.num_prompts) % self.prompts_per_step
        if tail_len == 0:
            return perm
        tail = prev[self.num_prompts - tail_len:]
        head = np.flatnonzero(~np.isin(perm, tail))[: self.prompts_per_step - tail_len]
        return np.concatenate([perm[head], np.delete(perm, head)])

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """Visiting order of `epoch`, computed forward from the cached (or first) epoch."""
        if self._cached is None or self._cached[0] > epoch:
            self._cached = (0, self._permutation(0))
        e, order = self._cached
        while e < epoch:
            e += 1
            order = self._next_epoch_order(e, order)
        self._cached = (e, order)
        return order

    def step_prompts(self, step: int) -> np.ndarray:
        """The `prompts_per_step` distinct prompt indices of `step` (all hosts)."""
        start = step * self.prompts_per_step
        epoch, offset = divmod(start, self.num_prompts)
        picked = self._epoch_order(epoch)[offset: offset + self.prompts_per_step]
        missing = self.prompts_per_step - len(picked)
        if missing:
            picked = np.concatenate([picked, self._epoch_order(epoch + 1)[:missing]])
        return picked

    def sample(self, step: int | None = None) -> list[tuple[int, int]]:
        """[(prompt_index, group_id)] for this host at `step` (default: the next step).

        group_id is the prompt's index within the step, shared by its `group_size` members.
        """
        step = self.step if step is None else step
        flat = [(int(p), g) for g, p in enumerate(self.step_prompts(step))
                for _ in range(self.group_size)]
        chunk = len(flat) // self.num_hosts
        self.step = step + 1
        return flat[self.host_index * chunk: (self.host_index + 1) * chunk]

    def state_dict(self) -> dict:
        """The next step plus the settings that define the order (checked on load)."""
        return {"step": self.step, "seed": self.seed, "num_prompts": self.num_prompts,
                "prompts_per_step": self.prompts_per_step, "group_size": self.group_size}

    def load_state_dict(self, state: dict) -> None:
        """Resume at state["step"]; ValueError if the order-defining settings differ."""
        mine = self.state_dict()
        changed = {k: (state[k], mine[k]) for k in mine if k != "step" and state[k] != mine[k]}
        if changed:
            raise ValueError(f"sampler settings differ from the checkpoint (saved, now): {changed}")
        self.step = int(state["step"])
