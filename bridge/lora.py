"""Flax LoRA pytree <-> PEFT/diffusers state dict, adapter_config.json, PEFT folders, vLLM-Omni names.

Numpy only (no JAX, no torch): the rollout side imports it too. Names come from `jaxflow.models.keymap`
(pure Python, its package's __init__ imports nothing); safetensors files through `bridge.safetensors_io`.

- Flax: the nested dict of `nnx.to_pure_dict(nnx.state(model, LoRAParam))`, leaves
  `blocks/<path>/lora_a` (L, in, r) and `lora_b` (L, r, out), stacked over the L blocks.
- PEFT: `transformer_blocks.N.<target>.lora_A.weight` (r, in) and `lora_B.weight` (out, r), an optional
  `transformer.` prefix (diffusers' pipeline namespace) accepted on input.
Conversions only transpose and stack: bit-exact both ways, in any dtype (bf16 stays bf16).

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
from jaxflow.models import keymap

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}
PREFIX = "transformer."
_KEY = re.compile(r"(?:transformer\.)?(?P<module>.+)\.lora_(?P<part>[AB])\.weight")
_LAYER = re.compile(r"transformer_blocks\.(\d+)\.")
# vLLM-Omni's fused Qwen-Image transformer: module renames its LoRA loader needs (diffusers -> vLLM-Omni).
VLLM_OMNI_RENAMES = {"to_out.0": "to_out"}


# ------------------------------------------------------------------------------------------ pytree <-> PEFT


def _flatten(tree: dict, prefix: tuple = ()) -> dict[tuple[str, ...], np.ndarray]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, prefix + (str(key),)))
        else:
            out[prefix + (str(key),)] = value
    return out


def _targets_in_tree(leaves) -> list[str]:
    paths = {path[1:-1] for path in leaves if path[:1] == (keymap.BLOCKS,)}
    return [t for t, path in keymap.LORA_TARGETS.items() if path in paths]


def flax_to_peft(tree: dict, targets=None) -> dict[str, np.ndarray]:
    """PEFT state dict (no prefix) from a Flax LoRA pytree; targets default to those present in the tree."""
    leaves = _flatten(tree)
    targets = _targets_in_tree(leaves) if targets is None else list(targets)
    out = {}
    for entry in keymap.lora_key_map(targets):
        if entry.flax_path not in leaves:
            raise ValueError(f"LoRA pytree: missing leaf {'/'.join(entry.flax_path)}")
        stacked = np.asarray(leaves.pop(entry.flax_path))
        if stacked.ndim != 3:
            raise ValueError(f"LoRA pytree: {'/'.join(entry.flax_path)} must be (L, a, b), got {stacked.shape}")
        for i, key in enumerate(entry.diffusers_keys(len(stacked))):
            out[key] = np.ascontiguousarray(stacked[i].T)
    if leaves:
        raise ValueError(f"LoRA pytree: leaves outside targets {targets}: {['/'.join(p) for p in leaves]}")
    return out


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def peft_to_flax(tensors: dict, targets=None) -> dict:
    """Flax LoRA pytree from a PEFT state dict (prefix optional); targets default to those in the keys.

    Every target needs both matrices for every block 0..L-1 (L from the keys); anything else is a ValueError.
    """
    tensors = {k.removeprefix(PREFIX): v for k, v in tensors.items()}
    layers = {int(m.group(1)) for k in tensors if (m := _LAYER.match(k))}
    if not layers:
        raise ValueError("PEFT state dict: no transformer_blocks.N.* keys")
    num_layers = max(layers) + 1
    if targets is None:
        modules = {lora_module(k).split(".", 2)[2] for k in tensors}
        targets = [t for t in keymap.LORA_TARGETS if keymap.BLOCK_LINEARS[keymap.LORA_TARGETS[t]] in modules]
    tree, used = {}, set()
    for entry in keymap.lora_key_map(targets):
        keys = entry.diffusers_keys(num_layers)
        missing = [k for k in keys if k not in tensors]
        if missing:
            raise ValueError(f"PEFT state dict: missing {missing[:5]} ({len(missing)} in all)")
        _set(tree, entry.flax_path, np.stack([np.asarray(tensors[k]).T for k in keys]))
        used.update(keys)
    unknown = sorted(set(tensors) - used)
    if unknown:
        raise ValueError(f"PEFT state dict: keys outside targets {list(targets)}: {unknown[:5]} "
                         f"({len(unknown)} in all)")
    return tree


# ------------------------------------------------------------------------------------------ PEFT folders


def adapter_config(rank: int, alpha: float, targets=keymap.DEFAULT_LORA_TARGETS) -> dict:
    """adapter_config.json content (PEFT, diffusers' load_lora_weights and vLLM read it)."""
    for t in targets:
        keymap.lora_target_path(t)
    if rank < 1 or alpha <= 0:
        raise ValueError(f"LoRA rank must be >= 1 and alpha > 0, got rank={rank}, alpha={alpha}")
    return {"peft_type": "LORA", "r": int(rank), "lora_alpha": float(alpha), "target_modules": list(targets),
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
