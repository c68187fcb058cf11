"""The embedded default: the tiny offline Qwen-Image, diffusers rollout on CPU, a few minutes on 2 cores.

    python -m jaxflow.train --config configs/tiny_ocr.py [--config.train.num_steps=20]

The real recipe (configs/qwen_ocr.py) with the tiny overrides of jaxflow/config/recipes.py: the same knobs at toy sizes.
"""
from jaxflow.config.recipes import base, tiny


def get_config():
    return tiny(base())
