"""Qwen-Image's LoRA spec: its target names (diffusers names inside a block) and PEFT keys from its key map
(jaxflow_bridge.families.qwen_image.keymap); the adapters are `jaxflow/nn/layers.Linear`'s and the PEFT conversion
is `jaxflow/nn/lora.py`'s."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from jaxflow.nn.lora import LoRASpec
from jaxflow_bridge.contract import lora as peft_folder
from jaxflow_bridge.contract.weight_keys import Entry
from jaxflow_bridge.families.qwen_image import keymap


@dataclasses.dataclass(frozen=True)
class QwenImageLoRASpec(LoRASpec):
    """rank r, alpha (scaling alpha/r) and target module names (diffusers names inside a block,
    keymap.LORA_TARGETS); an unknown target is refused by name."""

    targets: tuple[str, ...] = keymap.DEFAULT_LORA_TARGETS

    def target_path(self, target: str) -> tuple[str, ...]:
        return keymap.lora_target_path(target)

    def key_map(self) -> list[Entry]:
        return keymap.lora_key_map(self.targets)


def read_peft(directory: str | Path) -> tuple[QwenImageLoRASpec, dict[str, np.ndarray]]:
    """The spec and PEFT state dict (prefix dropped) of a PEFT folder."""
    tensors, cfg = peft_folder.read_peft(directory)
    spec = QwenImageLoRASpec(rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]), targets=tuple(cfg["target_modules"]))
    return spec, {k.removeprefix(peft_folder.PREFIX): v for k, v in tensors.items()}
