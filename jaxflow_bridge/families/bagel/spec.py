"""BAGEL's identity, defined once for both sides (the JAX `Family` and the torch engines read it): its name, its
tiny model's name, what makes a folder one, the image size multiple, the rule its base-weight fingerprint follows
and vLLM-Omni's deployments of it. Plain Python: imports neither jax/flax nor torch."""
from __future__ import annotations

import json
from pathlib import Path

from jaxflow_bridge.families.bagel.keymap import IGNORED_PREFIXES

NAME = "bagel"
TINY = "tiny_bagel"  # model.path / engine `model` of the cached tiny random BAGEL
FOLDER = "a BAGEL folder (config.json with model_type 'bagel')"
MODEL_TYPE = "bagel"
WEIGHTS = "ema.safetensors"

# vLLM-Omni 0.20's BAGEL topologies inside the installed package: "single_stage", one DiT stage doing prefill,
# denoising and decode; "two_stage", a thinker (vLLM's AR engine: the prompt's prefill, its KV sent to stage 1) and
# the DiT (docs/bagel.md §3). Without a deploy file a BAGEL folder starts the two-stage one.
DEPLOY_FILES = {"single_stage": ("deploy", "bagel_single_stage.yaml"), "two_stage": ("deploy", "bagel.yaml")}
DEPLOYS = tuple(DEPLOY_FILES)

ENGINES = ("bagel_torch", "vllm_omni")  # the rollout engines that serve it
LORA_COMPONENT = "bagel"  # the pipeline part vLLM-Omni's LoRA manager wraps (its layer names start with it)


def is_folder(folder: Path) -> bool:
    config = Path(folder) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == MODEL_TYPE


def pixels_per_token(top: dict) -> int:
    """Pixels per latent token (a side) of config.json's keys `top`: the VAE's downsampling x latent_patch_size
    (16 for the released BAGEL)."""
    return top["vae_config"]["downsample"] * top["latent_patch_size"]


def size_multiple(folder: Path) -> int:
    return pixels_per_token(json.loads((Path(folder) / "config.json").read_text()))


def fingerprint_files(folder: Path) -> tuple[Path, str, tuple[str, ...]]:
    """(folder, file pattern, names left out): ema.safetensors without the trainer-ignored prefixes."""
    return Path(folder), WEIGHTS, IGNORED_PREFIXES
