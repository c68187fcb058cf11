"""The real setting: Qwen-Image LoRA FlowGRPO on OCR prompts, vLLM-Omni rollout (values and sources:
jaxflow/config/recipes.py, whose base it is).

    python -m jaxflow.train --config configs/qwen_ocr.py --config.model.path=/models/Qwen-Image
"""
from jaxflow.config.recipes import base


def get_config():
    return base()
