"""The weighted multi-reward (flow_grpo `multi_score`) over the rewards of `registry.REGISTRY`."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from jaxflow_bridge.rewards.base import RewardFn, check_scores, score
from jaxflow_bridge.rewards.registry import REGISTRY


class MultiReward:
    """Weighted sum of named rewards; returns {name: (B,) float32, ..., "avg": sum_i w_i r_i}."""

    def __init__(self, rewards: Mapping[str, RewardFn], weights: Mapping[str, float]):
        if set(rewards) != set(weights):
            raise ValueError(f"rewards {sorted(rewards)} and weights {sorted(weights)} differ")
        self.rewards = dict(rewards)
        self.weights = {name: float(w) for name, w in weights.items()}

    @property
    def names(self) -> list[str]:
        return list(self.rewards)

    def score_one(self, name: str, images: np.ndarray, prompts: Sequence[str], sources: np.ndarray | None = None,
                  targets: Sequence[str | None] | None = None) -> np.ndarray:
        """One named reward, checked to be finite float32 (B,); `sources` and `targets` reach conditioned rewards
        only (base.py)."""
        return check_scores(name, score(self.rewards[name], images, prompts, sources, targets)[0], len(images))

    def combine(self, scores: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Add the weighted sum "avg" to per-reward scores."""
        out = dict(scores)
        avg = sum(self.weights[name] * scores[name] for name in self.names)
        out["avg"] = np.asarray(avg, dtype=np.float32)
        return out

    def __call__(self, images: np.ndarray, prompts: Sequence[str], sources: np.ndarray | None = None,
                 targets: Sequence[str | None] | None = None) -> dict[str, np.ndarray]:
        return self.combine({name: self.score_one(name, images, prompts, sources, targets) for name in self.names})


def build_reward(spec: Mapping[str, float], **options: Mapping) -> MultiReward:
    """Build a MultiReward from {name: weight}; `options[name]` are keyword args for that reward.

    Example: build_reward({"vlm_ocr": 1.0}, vlm_ocr={"base_url": "http://host:8000", "model": "m"}).
    Options for known rewards absent from `spec` are ignored (one config can carry them all). An option
    "actor": {"num_gpus": g, "num_cpus": c} builds that reward in a Ray actor of its own (jaxflow_bridge/rewards/remote.py).
    """
    unknown = [name for name in [*spec, *options] if name not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown reward(s) {unknown}; known: {sorted(REGISTRY)}")
    if not spec:
        raise ValueError(f"empty reward spec; known rewards: {sorted(REGISTRY)}")
    rewards = {}
    for name in spec:
        kwargs = dict(options.get(name) or {})
        actor = kwargs.pop("actor", None)  # {"num_gpus": .., "num_cpus": ..}: the model in a Ray actor of its own
        if actor is not None:
            from jaxflow_bridge.rewards.remote import RemoteReward
            rewards[name] = RemoteReward(name, kwargs, **dict(actor))
        else:
            rewards[name] = REGISTRY[name](**kwargs)
    return MultiReward(rewards, spec)
