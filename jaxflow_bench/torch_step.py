"""The train-step benchmark's torch baseline pieces (scripts/bench_train_step.py): the clipped policy objective in
torch. Imports torch, never JAX.
"""
from __future__ import annotations

import torch


def clipped_objective(log_prob, old_log_prob, advantages, clip_range: float, adv_clip: float):
    """Per-sample PPO terms max(-A r, -A clip(r, 1-eps, 1+eps)) (B,) and the ratio r = exp(logp - logp_old), A the
    advantages clamped to +-adv_clip; mirrors `jaxflow.algorithms.flowgrpo.clipped_objective` in torch."""
    ratio = torch.exp(log_prob - old_log_prob)
    adv = advantages.clamp(-adv_clip, adv_clip)
    terms = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - clip_range, 1.0 + clip_range))
    return terms, ratio
