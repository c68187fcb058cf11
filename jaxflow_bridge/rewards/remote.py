"""A reward model in a Ray actor of its own: its process, and a GPU when asked (`reward.options.<name>.actor`).

The trainer's process keeps JAX's fixed GPU pool; a reward model such as PickScore then runs beside the rollout
engines on a GPU Ray hands it, batched in its own dtype. The reward pool calls it from a worker thread like any
reward, so scoring overlaps the next rollout. Load errors (a missing checkpoint file) come back as the same one-line
exception the in-process model raises.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxflow_bridge.rewards.base import score


class _RewardHost:
    """The actor: builds the named reward in its process and scores batches."""

    def __init__(self, name: str, options: dict):
        from jaxflow_bridge.rewards.registry import REGISTRY

        self.fn, self.error = None, None
        try:
            self.fn = REGISTRY[name](**options)
        except (FileNotFoundError, ValueError) as exc:  # bad input: handed back whole, not as an actor death
            self.error = (type(exc).__name__, str(exc))

    def ready(self):
        """(error or None, whether the reward is conditioned: base.py)."""
        return self.error, getattr(self.fn, "conditioned", False)

    def score(self, images: np.ndarray, prompts: Sequence[str], conditions: dict) -> tuple[np.ndarray, dict]:
        scores, counts = score(self.fn, images, prompts, conditions.get("sources"), conditions.get("targets"))
        return np.asarray(scores, dtype=np.float32), counts


class RemoteReward:
    """fn(images, prompts, **conditions) -> (B,) float32, scored by the reward `name` in a Ray actor with `num_gpus`
    and `num_cpus`; conditioned and counted as that reward is (base.py). Needs Ray running (the trainer starts it
    before the rewards unless the layout is in_process)."""

    def __init__(self, name: str, options: dict, num_gpus: float = 0.0, num_cpus: float = 1.0):
        import ray

        actor = ray.remote(num_gpus=num_gpus, num_cpus=num_cpus)(_RewardHost)
        self.actor = actor.remote(name, dict(options))
        error, self.conditioned = ray.get(self.actor.ready.remote())
        if error is not None:
            ray.kill(self.actor)
            kind, message = error
            raise (FileNotFoundError if kind == "FileNotFoundError" else ValueError)(message)

    def scored(self, images: np.ndarray, prompts: Sequence[str], **conditions) -> tuple[np.ndarray, dict]:
        """(scores, the reward's counts: {} unless it is counted)."""
        import ray

        return ray.get(self.actor.score.remote(images, list(prompts), conditions))

    def __call__(self, images: np.ndarray, prompts: Sequence[str], **conditions) -> np.ndarray:
        return self.scored(images, prompts, **conditions)[0]
