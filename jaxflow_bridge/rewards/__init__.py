"""Rewards: fn(images uint8 (B,H,W,3), prompts list[str]) -> float32 (B,), combined (`multi`) and pooled (`pool`).

Pixel and OCR rewards in numpy/onnxruntime; the served VLM's rewards over HTTP (`vlm/`); reward models in torch
(`models/`: transformers' CLIP, HPS, ImageReward and their preprocessing), loaded from local checkpoint folders only
when used. Never imports JAX.
"""

from jaxflow_bridge.rewards.base import RewardFn, check_batch
from jaxflow_bridge.rewards.jpeg import jpeg_compressibility, jpeg_incompressibility
from jaxflow_bridge.rewards.multi import MultiReward, build_reward
from jaxflow_bridge.rewards.registry import REGISTRY
from jaxflow_bridge.rewards.ocr import OcrReward
from jaxflow_bridge.rewards.pool import RewardPool
from jaxflow_bridge.rewards.text import edit_score, extract_target, normalize_text
from jaxflow_bridge.rewards.vlm.vlm_ocr import VlmOcrReward

__all__ = [
    "REGISTRY", "MultiReward", "OcrReward", "RewardFn", "RewardPool", "VlmOcrReward",
    "build_reward", "check_batch", "edit_score", "extract_target", "jpeg_compressibility",
    "jpeg_incompressibility", "normalize_text",
]
