"""PEFT LoRA adapters on numpy: adapter_config.json (written and checked), PEFT folders, LoRA key names,
vLLM-Omni names.

Numpy only (no JAX, no torch): the trainer and the rollout both import it; safetensors files go through
`jaxflow_bridge.contract.safetensors_io`. PEFT keys are `transformer_blocks.N.<target>.lora_A.weight` (r, in) and
`lora_B.weight` (out, r), an optional `transformer.` prefix (diffusers' pipeline namespace) accepted on input.
(The trainer's Flax LoRA state <-> PEFT arrays conversion is `jaxflow.nn.lora`.)

vLLM-Omni 0.20 (verified in its source, see `to_vllm_omni`): its LoRA loader wants `attn.to_out` where PEFT
says `attn.to_out.0`, in the tensor names and in adapter_config's target_modules; q/k/v and add_q/k/v stay per
projection, because the engine splits them onto its fused `to_qkv` / `add_kv_proj` layers itself.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np

from jaxflow_bridge.contract import safetensors_io

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PREFIX = "transformer."
MAX_LISTED = 20  # errors listed when an adapter is refused
_UNSUPPORTED = ("use_dora", "rank_pattern", "alpha_pattern", "lora_bias", "modules_to_save", "fan_in_fan_out",
                "target_parameters", "layer_replication")
# PEFT LoRA key: `[transformer.]<module>.lora_A.weight` / `.lora_B.weight`
LORA_KEY = re.compile(r"(?:transformer\.)?(?P<module>.+)\.lora_(?P<part>[AB])\.weight")
# vLLM-Omni's fused diffusion transformer: module renames its LoRA loader needs (diffusers -> vLLM-Omni).
VLLM_OMNI_RENAMES = {"to_out.0": "to_out"}


# ------------------------------------------------------------------------------------------ PEFT folders


def adapter_config(rank: int, alpha: float, targets) -> dict:
    """adapter_config.json content (PEFT, diffusers' load_lora_weights and vLLM read it); `targets`: module names
    inside a block, e.g. "to_q", "img_mlp.net.2"."""
    return {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
            "init_lora_weights": "gaussian", "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
            "use_dora": False, "fan_in_fan_out": False}


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    """An adapter's rank, alpha, rslora and bound modules: what injected LoRA layers depend on."""

    rank: int
    alpha: float
    rslora: bool
    modules: tuple[str, ...] = ()


def refusal(errors: list[str], what: str) -> ValueError:
    """The ValueError refusing an adapter, listing the first MAX_LISTED `errors`."""
    listed = "; ".join(errors[:MAX_LISTED])
    more = f"; ... and {len(errors) - MAX_LISTED} more" if len(errors) > MAX_LISTED else ""
    return ValueError(f"LoRA adapter refused ({len(errors)} {what}; the previous adapter keeps serving): "
                      f"{listed}{more}")


def adapter_spec(config: dict) -> AdapterSpec:
    """Rank, alpha and rslora from a PEFT adapter_config; ValueError on missing or unsupported options."""
    errors = [f"{k}: unsupported" for k in _UNSUPPORTED if config.get(k)]
    if config.get("bias", "none") != "none":
        errors.append(f"bias={config['bias']!r}: unsupported")
    if config.get("peft_type", "LORA") != "LORA":
        errors.append(f"peft_type={config['peft_type']!r}: expected 'LORA'")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or config[key] <= 0:
            errors.append(f"{key}: expected a positive number, got {config.get(key)!r}")
    if isinstance(config.get("r"), float) and not config["r"].is_integer():
        errors.append(f"r: expected an int, got {config['r']!r}")
    if errors:
        raise refusal(errors, "adapter_config problems")
    return AdapterSpec(int(config["r"]), float(config["lora_alpha"]), bool(config.get("use_rslora", False)))


def write_peft(directory, tensors: dict, config: dict, *, diffusers: bool = False, replace: bool = False) -> Path:
    """Write adapter_model.safetensors + adapter_config.json; tensors (numpy) keep their dtype.

    Both files are written beside the folder, then moved in: a new folder appears complete or not at all. An
    existing folder is refused unless `replace` (then its two files are replaced, each atomically).
    diffusers: tensor keys, and the r/alpha metadata diffusers reads, under its `transformer.` pipeline prefix, so
    `QwenImagePipeline.load_lora_weights(dir, weight_name="adapter_model.safetensors")` loads the folder as is.
    """
    directory = Path(directory)
    if directory.exists() and not replace:
        raise FileExistsError(f"{directory} exists; PEFT folders are written once")
    metadata = None
    if diffusers:
        tensors = {PREFIX + k: v for k, v in tensors.items()}
        packed = json.dumps({PREFIX + k: v for k, v in config.items()}, sort_keys=True)
        metadata = {"format": "pt", "lora_adapter_metadata": packed}
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        safetensors_io.save(tensors, tmp / ADAPTER_WEIGHTS, metadata)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
        if directory.exists():
            for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
                (tmp / name).replace(directory / name)
        else:
            tmp.rename(directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def read_peft(path) -> tuple[dict[str, np.ndarray], dict | None]:
    """(tensors, adapter_config) of a PEFT folder or of its .safetensors file alone.

    Tensors keep their stored names (prefix included) and dtypes; adapter_config is None when no
    adapter_config.json lies beside the weights.
    """
    path = Path(path)
    weights = path / ADAPTER_WEIGHTS if path.is_dir() else path
    config = weights.parent / ADAPTER_CONFIG
    return safetensors_io.load(weights), json.loads(config.read_text()) if config.is_file() else None


# ------------------------------------------------------------------------------------------ modules


def lora_module(key: str) -> str:
    """The module a PEFT LoRA key belongs to, prefix dropped; ValueError for anything else."""
    match = LORA_KEY.fullmatch(key)
    if match is None:
        raise ValueError(f"{key}: not a PEFT LoRA key '<module>.lora_A.weight' / '<module>.lora_B.weight'")
    return match["module"]


def lora_pairs(tensors: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{module: (lora_A (r, in), lora_B (out, r))}; ValueError on foreign keys or a half-present pair."""
    parts: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        parts.setdefault(lora_module(key), {})[LORA_KEY.fullmatch(key)["part"]] = value
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
