"""LoRA on BAGEL's generation expert (docs/bagel.md §5): the spec naming BAGEL's targets and PEFT keys
(jaxflow_bridge.families.bagel.keymap), and the PEFT state dict of a model's adapters. The adapters themselves are
models/layers.Linear's, and the conversion is jaxflow/nn/lora.py's (it reads the names through the spec)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from flax import nnx

from jaxflow.nn.lora import LoRASpec, lora_to_peft, peft_to_lora
from jaxflow_bridge.families.bagel import keymap as bagel_keymap
from jaxflow_bridge.contract import lora as peft_folder
from jaxflow_bridge.contract.weight_keys import Entry


@dataclasses.dataclass(frozen=True)
class BagelLoRASpec(LoRASpec):
    """rank r, alpha (scaling alpha/r) and BAGEL target names (bagel_keymap.LORA_TARGETS: the generation expert's
    `q_proj_moe_gen` ... `mlp_moe_gen.down_proj`); an unknown target is refused by name."""

    targets: tuple[str, ...] = bagel_keymap.DEFAULT_LORA_TARGETS

    def target_path(self, target: str) -> tuple[str, ...]:
        return bagel_keymap.lora_target_path(target)

    def key_map(self) -> list[Entry]:
        return bagel_keymap.lora_key_map(self.targets)


def expert_targets(spec: LoRASpec | None) -> frozenset[str]:
    """The generation expert's Linear leaves `spec` adapts (empty without a spec); refuses a non-BAGEL target."""
    if spec is None:
        return frozenset()
    return frozenset(bagel_keymap.lora_target_path(t)[-1] for t in spec.targets)


def peft_state_dict(model: nnx.Module | nnx.State, spec: BagelLoRASpec) -> dict[str, np.ndarray]:
    """The adapters as a PEFT state dict in BAGEL's checkpoint names (host arrays, torch layout, one tensor per
    layer): `base_model.model.language_model.model.layers.{i}.self_attn.q_proj_moe_gen.lora_A.weight` ..."""
    return {bagel_keymap.PEFT_PREFIX + k: v for k, v in lora_to_peft(model, spec).items()}


def set_peft(model: nnx.Module, spec: BagelLoRASpec, tensors: dict[str, np.ndarray]) -> None:
    """Set the model's adapters from a PEFT state dict in BAGEL's names (PEFT_PREFIX optional); every key and shape
    is checked before any write (models/lora.peft_to_lora)."""
    peft_to_lora(model, spec, {k.removeprefix(bagel_keymap.PEFT_PREFIX): v for k, v in tensors.items()})


def save_peft(model: nnx.Module | nnx.State, spec: BagelLoRASpec, directory: str | Path) -> Path:
    """Write the adapters as a PEFT folder in BAGEL's names (adapter_model.safetensors with `peft_state_dict`'s keys,
    adapter_config.json with r, alpha and the generation expert's targets); an adapter already there is replaced,
    each file atomically (`jaxflow_bridge.contract.lora.write_peft`)."""
    return peft_folder.write_peft(directory, peft_state_dict(model, spec), spec.peft_config(), replace=True)


def read_peft(directory: str | Path) -> tuple[BagelLoRASpec, dict[str, np.ndarray]]:
    """(spec, PEFT state dict) of a BAGEL PEFT folder; ValueError naming the folder when adapter_config.json is
    missing, and a target that is not the generation expert's is refused by name (`BagelLoRASpec`)."""
    tensors, cfg = peft_folder.read_peft(directory)
    if cfg is None:
        raise ValueError(f"{directory}: no adapter_config.json beside the adapter weights (r, lora_alpha, "
                         "target_modules are needed)")
    spec = BagelLoRASpec(rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]), targets=tuple(cfg["target_modules"]))
    return spec, tensors
