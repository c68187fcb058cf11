"""The model kinds the vllm_omni engine serves, one per family of the registry
(`engines/families.py`), told apart by the model folder (its family's `spec.is_folder`) or a tiny model's name.

A kind (`jaxflow_bridge/families/<name>/vllm_omni_kind.py`) gives the engine what differs between families: the
custom pipeline's arguments (its class and options, the options it refuses), AsyncOmni's start arguments and stage
count, the first stage's sampling parameters, the base weights' fingerprint, the image size multiple, the sampling
parameters and request codec, and the adapter's tensor names as vLLM-Omni binds them. Our pipeline,
`RolloutWorkerExtension` and output codec run on the (last) diffusion stage.
"""
from __future__ import annotations

from pathlib import Path

from jaxflow_bridge.engines import families


def family_of(model: str) -> str:
    """The family of `model` (a folder, or a family's tiny model name); ValueError in one line for a folder of no
    family."""
    specs = [families.spec(name) for name in families.FAMILIES]
    for spec in specs:
        if model == spec.TINY or spec.is_folder(Path(model)):
            return spec.NAME
    raise ValueError(f"vllm_omni engine: {model} is neither {' nor '.join(s.FOLDER for s in specs)}")


def model_kind(model: str, dtype: str, deploy: str | None = None):
    """The kind serving `model` (`family_of`; a tiny model: its cached folder saved in `dtype`), in the topology
    `deploy` where its family has several (None: its default; the engine's rules, `rules.py`, refuse another)."""
    spec = families.spec(family_of(model))
    kinds = families.module(spec.NAME, "vllm_omni_kind")
    return kinds.VllmOmniKind(kinds.tiny_folder(dtype) if model == spec.TINY else Path(model), deploy)
