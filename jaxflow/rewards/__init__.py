"""Rewards: fn(images uint8 (B,H,W,3), prompts list[str]) -> float32 (B,), combined and pooled."""

from jaxflow.rewards.base import RewardFn, check_batch
from jaxflow.rewards.jpeg import jpeg_compressibility, jpeg_incompressibility
from jaxflow.rewards.multi import REGISTRY, MultiReward, build_reward
from jaxflow.rewards.ocr import OcrReward
from jaxflow.rewards.pool import RewardPool
from jaxflow.rewards.text import edit_score, extract_target, normalize_text
from jaxflow.rewards.vlm_ocr import VlmOcrReward

__all__ = [
    "REGISTRY", "MultiReward", "OcrReward", "RewardFn", "RewardPool", "VlmOcrReward",
    "build_reward", "check_batch", "edit_score", "extract_target", "jpeg_compressibility",
    "jpeg_incompressibility", "normalize_text",
]
