"""The transformer with the shared random base weights (`jaxflow_bridge/contract/random_weights.py`), each leaf drawn
on device straight into its sharding (`jaxflow/nn/random_init.py`; the rollout draws the same in torch, the
fingerprint check compares)."""
from __future__ import annotations

import functools

from jaxflow.families.qwen_image.loading import ShardingFn, assemble
from jaxflow.families.qwen_image.transformer import QwenImageTransformer
from jaxflow.families.qwen_image.config import QwenImageConfig
from jaxflow.nn.config import ModelOptions
from jaxflow.nn.lora import LoRASpec
from jaxflow.nn.random_init import entry_value


def random_transformer(cfg: QwenImageConfig, opts: ModelOptions = ModelOptions(), lora: LoRASpec | None = None,
                       *, sharding: ShardingFn | None = None, seed: int = 0,
                       model_type: type[QwenImageTransformer] = QwenImageTransformer) -> QwenImageTransformer:
    """The `model_type` model with base weights drawn by the shared spec from `seed` (fresh LoRA from `seed` if
    `lora`)."""
    return assemble(cfg, opts, lora, seed, sharding, functools.partial(entry_value, seed, cfg.num_layers),
                    model_type=model_type)
