"""Group advantages (flow_grpo `flow_grpo/stat_tracking.py`; docs/numerics.md §4): what the driver hands every
algorithm with the rewards."""
from __future__ import annotations

import numpy as np


def compute_advantages(rewards, group_ids, *, global_std: bool = True, eps: float = 1e-4, clip: float = 5.0,
                       expected_group_size: int | None = None) -> tuple[np.ndarray, float]:
    """A = (r - mean of r's group) / (std + eps), clamped to +-clip; returns (A (B,) float32, zero_std_ratio).

    std is over the whole batch (`global_std`, flow_grpo's default) or over each group (population std,
    ddof=0). Groups may have any size; with `expected_group_size` an incomplete group is a ValueError.
    A group whose rewards are all equal gets exactly 0; zero_std_ratio is the fraction of such groups.
    """
    rewards = np.asarray(rewards, np.float64)
    group_ids = np.asarray(group_ids)
    if rewards.ndim != 1 or group_ids.shape != rewards.shape or not rewards.size:
        raise ValueError(f"rewards {rewards.shape} and group_ids {group_ids.shape} must be equal non-empty (B,)")
    groups, inverse, counts = np.unique(group_ids, return_inverse=True, return_counts=True)
    if expected_group_size is not None and np.any(counts != expected_group_size):
        bad = np.flatnonzero(counts != expected_group_size)[0]
        raise ValueError(f"group {groups[bad].item()!r} has {counts[bad]} samples, expected {expected_group_size}")
    mean = np.bincount(inverse, rewards) / counts
    lo, hi = np.full(len(groups), np.inf), np.full(len(groups), -np.inf)
    np.minimum.at(lo, inverse, rewards)
    np.maximum.at(hi, inverse, rewards)
    constant = lo == hi
    centered = np.where(constant[inverse], 0.0, rewards - mean[inverse])
    if global_std:
        std = rewards.std()
    else:
        std = np.sqrt(np.bincount(inverse, centered**2) / counts)[inverse]
    advantages = np.clip(centered / (std + eps), -clip, clip).astype(np.float32)
    return advantages, float(constant.mean())
