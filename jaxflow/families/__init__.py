"""The model families the training program runs, chosen by `model.family` (docs/bagel.md §7 (e)); each a folder
here holding its model, key map and loading, CFG forward and log-prob, LoRA targets and checks, behind the `Family`
protocol (`base.py`). The train step is the same for every family: it asks the model's family for its objective."""
from __future__ import annotations

from jaxflow.families.bagel.family import Bagel
from jaxflow.families.base import Family
from jaxflow.families.qwen_image.family import QwenImage
from jaxflow.families.qwen_image_edit.family import QwenImageEdit

_FAMILIES: dict[str, Family] = {f.name: f for f in (
    QwenImage(),
    QwenImageEdit(),
    Bagel(),
)}
FAMILIES = tuple(_FAMILIES)


def by_name(name: str) -> Family:
    """The family called `name` (one of FAMILIES)."""
    return _FAMILIES[name]


def of(cfg) -> Family:
    """The config's family (`model.family`, validated at start)."""
    return by_name(cfg.model.family)


def of_model(model) -> Family:
    """The family whose model `model` is."""
    return next(f for f in _FAMILIES.values() if f.owns(model))


def of_lora_spec(spec) -> Family:
    """The family whose LoRA spec `spec` is."""
    return next(f for f in _FAMILIES.values() if isinstance(spec, f.lora_spec_type))
