"""PEFT LoRA adapters on numpy: adapter_config.json, PEFT folders, LoRA key names, vLLM-Omni names.

Numpy only (no JAX, no torch): the trainer and the rollout both import it; safetensors files go through
`bridge.safetensors_io`. PEFT keys are `transformer_blocks.N.<target>.lora_A.weight` (r, in) and
`lora_B.weight` (out, r), an optional `transformer.` prefix (diffusers' pipeline namespace) accepted on input.
(The trainer's Flax LoRA state <-> PEFT arrays conversion is `jaxflow.models.lora`.)

vLLM-Omni 0.20 (verified in its source, see `to_vllm_omni`): its LoRA loader wants `attn.to_out` where PEFT
says `attn.to_out.0`, in the tensor names and in adapter_config's target_modules; q/k/v and add_q/k/v stay per
projection, because the engine splits them onto its fused `to_qkv` / `add_kv_proj` layers itself.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

from bridge import safetensors_io

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}
PREFIX = "transformer."
_KEY = re.compile(r"(?:transformer\.)?(?P<module>.+)\.lora_(?P<part>[AB])\.weight")
# vLLM-Omni's fused Qwen-Image transformer: module renames its LoRA loader needs (diffusers -> vLLM-Omni).
VLLM_OMNI_RENAMES = {"to_out.0": "to_out"}


# ------------------------------------------------------------------------------------------ PEFT folders


def adapter_config(rank: int, alpha: float, targets) -> dict:
    """adapter_config.json content (PEFT, diffusers' load_lora_weights and vLLM read it); `targets`: module names
    inside a block, e.g. "to_q", "img_mlp.net.2"."""
    return {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
            "init_lora_weights": "gaussian", "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
            "use_dora": False, "fan_in_fan_out": False}


def write_peft(directory, tensors: dict, config: dict, dtype: str | None = None) -> Path:
    """Write adapter_model.safetensors + adapter_config.json into a new folder, atomically.

    dtype: "bfloat16" or "float32" to cast, None to keep each tensor's dtype. The folder appears complete or
    not at all (written beside it, then renamed); an existing folder is refused.
    """
    directory = Path(directory)
    if directory.exists():
        raise FileExistsError(f"{directory} exists; PEFT folders are written once")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or None, got {dtype!r}")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        arrays = {k: np.asarray(v, DTYPES[dtype]) if dtype else np.asarray(v) for k, v in tensors.items()}
        safetensors_io.save(arrays, tmp / ADAPTER_WEIGHTS)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
        tmp.rename(directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def read_peft(directory) -> tuple[dict[str, np.ndarray], dict]:
    """(tensors, adapter_config) of a PEFT folder; tensors keep their stored dtype."""
    directory = Path(directory)
    tensors = safetensors_io.load(directory / ADAPTER_WEIGHTS)
    return tensors, json.loads((directory / ADAPTER_CONFIG).read_text())


# ------------------------------------------------------------------------------------------ modules


def lora_module(key: str) -> str:
    """The module a PEFT LoRA key belongs to, prefix dropped; ValueError for anything else."""
    match = _KEY.fullmatch(key)
    if match is None:
        raise ValueError(f"{key}: not a PEFT LoRA key '<module>.lora_A.weight' / '<module>.lora_B.weight'")
    return match["module"]


def lora_pairs(tensors: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{module: (lora_A (r, in), lora_B (out, r))}; ValueError on foreign keys or a half-present pair."""
    parts: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        parts.setdefault(lora_module(key), {})[_KEY.fullmatch(key)["part"]] = value
    halves = sorted(m for m, p in parts.items() if len(p) != 2)
    if halves:
        raise ValueError(f"LoRA modules with only one of lora_A/lora_B: {halves[:5]} ({len(halves)} in all)")
    return {m: (p["A"], p["B"]) for m, p in parts.items()}


def bound_modules(tensors: dict) -> int:
    """How many modules the adapter carries (complete lora_A/lora_B pairs)."""
    return len(lora_pairs(tensors))


# ------------------------------------------------------------------------------------------ vLLM-Omni


def _rename(module: str) -> str:
    for old, new in VLLM_OMNI_RENAMES.items():
        if module == old or module.endswith("." + old):
            return module[: len(module) - len(old)] + new
    return module


def to_vllm_omni(tensors: dict) -> dict:
    """PEFT tensors under the module names vLLM-Omni 0.20's LoRA loader binds (prefix dropped).

    Its `DiffusionLoRAManager` (vllm_omni/diffusion/lora/manager.py) loads through vLLM's
    `LoRAModel.from_local_checkpoint`, which refuses a module whose last name part is not a LoRA-capable
    layer suffix of the pipeline ("0" of `to_out.0` is not: vLLM-Omni's `to_out` is one RowParallelLinear), and
    binds by exact module name. `to_q/to_k/to_v` and `add_{q,k,v}_proj` stay: the manager expands the fused
    `to_qkv` / `add_kv_proj` into them through the transformer's `stacked_params_mapping`.
    """
    out = {}
    for key, value in tensors.items():
        module = lora_module(key)
        out[f"{_rename(module)}{key[key.rindex('.lora_'):]}"] = value
    return out


def vllm_omni_adapter_config(config: dict) -> dict:
    """adapter_config with target_modules renamed as in `to_vllm_omni`.

    vLLM-Omni picks the layers to wrap by matching each target as the regex `.*\\.<target>$` against full module
    names; `to_out.0` would match nothing there, and that layer would silently carry no LoRA.
    """
    targets = config.get("target_modules")
    if isinstance(targets, str) or targets is None:
        return dict(config)
    return {**config, "target_modules": [_rename(t) for t in targets]}
