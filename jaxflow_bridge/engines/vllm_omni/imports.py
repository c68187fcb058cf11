"""vLLM-Omni's classes for the engine (`engine.py`), imported when an engine starts (this machine may lack them:
then an ImportError saying how to install them), and the path its spawned workers import `jaxflow_bridge` from."""

from __future__ import annotations

import os
from pathlib import Path

import jaxflow_bridge

INSTALL_HINT = ("the 'vllm_omni' rollout engine needs vLLM-Omni 0.20 on a CUDA machine: `pip install jaxflow[omni]`, "
                "or, where the machine has no package index, stage the wheels here with "
                "launch/stage_vllm_omni.sh and install them there with launch/install_staged.sh")


def export_package_path() -> None:
    """Let vLLM-Omni's spawned workers import `jaxflow_bridge` (they resolve our classes by module path)."""
    root = str(Path(jaxflow_bridge.__file__).resolve().parents[1])
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root] + [p for p in paths if p])


def import_text_params():
    """vLLM's SamplingParams: a two-stage deployment's thinker is a vLLM AR engine."""
    try:
        from vllm import SamplingParams
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return SamplingParams


def import_omni():
    """vLLM-Omni's AsyncOmni, OmniDiffusionSamplingParams and LoRARequest."""
    try:
        from vllm_omni.entrypoints.async_omni import AsyncOmni
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams
        from vllm_omni.lora.request import LoRARequest
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return AsyncOmni, OmniDiffusionSamplingParams, LoRARequest
