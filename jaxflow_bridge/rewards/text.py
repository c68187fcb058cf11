"""Target extraction and the normalised-Levenshtein text score shared by the OCR rewards."""

from __future__ import annotations

import re

import Levenshtein

_QUOTED = re.compile(r'"([^"]*)"')


def extract_target(prompt: str) -> str | None:
    """Text between the first pair of double quotes, or None if absent or blank."""
    match = _QUOTED.search(prompt)
    if match is None or not match.group(1).strip():
        return None
    return match.group(1)


def require_target(prompt: str) -> str:
    """`extract_target` that raises ValueError when the prompt has no quoted target."""
    target = extract_target(prompt)
    if target is None:
        raise ValueError(f"prompt has no quoted target text: {prompt!r}")
    return target


def normalize_text(text: str) -> str:
    """Remove all whitespace and lowercase."""
    return "".join(text.split()).lower()


def edit_score(recognized: str, target: str) -> float:
    """1 if target is a substring of recognized, else 1 - min(lev, len)/len (after normalising).

    flow_grpo strips only ' '; we strip all whitespace so VLM newlines do not cost edits.
    """
    rec, tgt = normalize_text(recognized), normalize_text(target)
    if not tgt:
        raise ValueError("target text is empty after removing whitespace")
    if tgt in rec:
        return 1.0
    dist = Levenshtein.distance(rec, tgt)
    return 1.0 - min(dist, len(tgt)) / len(tgt)
