"""Qwen-Image-Edit's key map: its transformer is Qwen-Image's (`QwenImageTransformer2DModel`, the same checkpoint
names), so the map is the base family's, re-exported. Pure Python."""
from __future__ import annotations

from jaxflow_bridge.families.qwen_image.keymap import (  # noqa: F401  (the base family's map)
    DEFAULT_LORA_TARGETS, LORA_TARGETS, lora_key_map, lora_target_path, transformer_key_map)
