"""Qwen-Image's identity, defined once for both sides (the JAX `Family` and the torch engines read it): its name,
its tiny model's name, what makes a folder one, the image size multiple and the rule its base-weight fingerprint
follows. Plain Python: imports neither jax/flax nor torch."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

NAME = "qwen_image"
LABEL = "Qwen-Image"  # its name in messages
TINY = "tiny"  # model.path / engine `model` of the cached tiny offline Qwen-Image
FOLDER = "a diffusers Qwen-Image folder (model_index.json)"
MARKER = "model_index.json"
PIPELINE_CLASS = "QwenImagePipeline"  # model_index.json's _class_name: an edit pipeline's folder is another family's
WEIGHTS = "transformer"  # the fingerprinted weights: every safetensors file of the folder's transformer/

ENGINES = ("diffusers", "vllm_omni")  # the rollout engines that serve it
LORA_COMPONENT = "transformer"  # the pipeline part vLLM-Omni's LoRA manager wraps (its layer names start with it)
# `jaxflow_bench.e2e --recipe qwen_image`: its recipe, the random full-size folder it trains (where, the file that
# marks it written, the command that writes it), the model.init it runs that folder with, and whether the recipe
# runs on one GPU only (vLLM-Omni's rollout beside the trainer, JAX's pool at half the GPU, 2 samples a micro-batch)
E2E = dict(config="configs/qwen_ocr.py", folder="/tmp/qwen_random", marker="model_index.json",
           writer=["scripts/make_random_pipeline.py", "--no-transformer-weights"], init="random", one_gpu=False)

# scheduler/scheduler_config.json of the Hugging Face model Qwen/Qwen-Image (docs/numerics.md §1).
SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "invert_sigmas": False,
    "stochastic_sampling": False,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
}


def pipeline_class(folder: Path) -> str | None:
    """model_index.json's `_class_name` (the diffusers pipeline the folder holds), None without one."""
    path = Path(folder) / MARKER
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get("_class_name")
    except (ValueError, AttributeError):  # not JSON, or not an object: no pipeline class
        return None


def is_folder(folder: Path) -> bool:
    return pipeline_class(folder) == PIPELINE_CLASS


def pixels_per_token(vae_config: dict) -> int:
    """Pixels a packed latent token spans per side: the VAE's 2 ** len(temperal_downsample) (its config.json's
    spelling) times the 2 x 2 patch packing; 16 for the released VAE. Image sides must be multiples of it."""
    return 2 * 2 ** len(vae_config["temperal_downsample"])


def size_multiple(folder: Path) -> int:
    """`pixels_per_token` of the folder's vae/config.json."""
    return pixels_per_token(json.loads((Path(folder) / "vae" / "config.json").read_text()))


def fingerprint_files(folder: Path) -> tuple[Path, str, tuple[str, ...]]:
    """(folder, file pattern, names left out) of the weights the base-weight fingerprint covers."""
    return Path(folder) / WEIGHTS, "*.safetensors", ()


def vllm_omni_problems(*, init: str, deploy: str | None, think: bool) -> Iterator[tuple[str, str]]:
    """The family's part of the vllm_omni engine's rules (`jaxflow_bridge/engines/vllm_omni/rules.py`): Qwen-Image
    runs vLLM-Omni's default stage, so no deployment is chosen (its `engine_config` names none)."""
    if deploy is not None:
        yield "rollout.bagel_deploy", f"{deploy!r} chooses BAGEL's topology; Qwen-Image runs one stage: drop it"
