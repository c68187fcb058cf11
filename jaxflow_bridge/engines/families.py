"""The model families the engines serve, one line each: its name -> its torch folder (jaxflow_bridge/families/<name>/:
spec.py, its engines' pipelines, its random model folders). The JAX side's registry is jaxflow/families/__init__.py."""
from __future__ import annotations

import importlib
from types import ModuleType

FAMILIES: dict[str, str] = {
    "qwen_image": "jaxflow_bridge.families.qwen_image",
    "qwen_image_edit": "jaxflow_bridge.families.qwen_image_edit",
    "bagel": "jaxflow_bridge.families.bagel",
}
DEFAULT = "qwen_image"  # model.family's default: the real recipe's family (jaxflow/config/recipes.py base())


def module(name: str, part: str) -> ModuleType:
    """The family `name`'s module `part` (e.g. "spec", "vllm_omni_kind"), imported on demand."""
    return importlib.import_module(f"{FAMILIES[name]}.{part}")


def spec(name: str) -> ModuleType:
    return module(name, "spec")
