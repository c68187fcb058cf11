"""Process 0's side of a step: prompts, the rollout, rewards and advantages make the train batch."""
from __future__ import annotations

import numpy as np


def sample_seeds(seed: int, step: int, count: int) -> np.ndarray:
    """Per-sample rollout seeds, a pure function of (seed, step, index): a resumed run draws the same noise."""
    return np.random.default_rng([seed, step]).integers(0, 2 ** 62, size=count)


def pad_text(batch: dict, length: int) -> dict:
    """Right-pad prompt (and negative) embeds/masks to `length` tokens (sample.max_sequence_length: the rollout
    refuses longer prompts), so every batch has one text shape and the jitted step compiles once."""
    out = dict(batch)
    for emb, mask in (("prompt_embeds", "prompt_mask"), ("negative_prompt_embeds", "negative_prompt_mask")):
        if out.get(emb) is None:
            continue
        pad = length - out[emb].shape[1]
        if pad < 0:
            raise ValueError(f"{emb} has {out[emb].shape[1]} tokens > sample.max_sequence_length={length}")
        out[emb] = np.pad(out[emb], ((0, 0), (0, pad), (0, 0)))
        out[mask] = np.pad(out[mask], ((0, 0), (0, pad)))
    return out


def merge_rewards(futures: dict) -> dict[str, np.ndarray]:
    """The reward pool's results of a step's chunks (`futures`: chunk index -> future) as one batch's."""
    parts = [futures[c].result() for c in sorted(futures)]
    out = {k: np.concatenate([p[k] for p in parts]) for k in parts[0] if k != "errors"}
    out["errors"] = sum(p["errors"] for p in parts)
    return out
