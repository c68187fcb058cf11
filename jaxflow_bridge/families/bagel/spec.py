"""BAGEL's identity, defined once for both sides (the JAX `Family` and the torch engines read it): its name, its
tiny model's name, what makes a folder one, the image size multiple, the rule its base-weight fingerprint follows
and vLLM-Omni's deployments of it. Plain Python: imports neither jax/flax nor torch."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from jaxflow_bridge.families.bagel.keymap import IGNORED_PREFIXES

NAME = "bagel"
LABEL = "BAGEL"  # its name in messages
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
# `jaxflow_bench.e2e --recipe bagel` (as Qwen-Image's spec.E2E): vLLM-Omni's BAGEL has no random-weight path, so the
# random folder holds weights
E2E = dict(config="configs/bagel_ocr.py", folder="/tmp/bagel_random", marker="ema.safetensors",
           writer=["scripts/make_random_bagel.py"], init="checkpoint", one_gpu=True)


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


def vllm_omni_problems(*, init: str, deploy: str | None, think: bool) -> Iterator[tuple[str, str]]:
    """What vLLM-Omni's BAGEL does not run, as (config key, message): the family's part of the vllm_omni engine's
    rules (`jaxflow_bridge/engines/vllm_omni/rules.py`), checked by the validation stage and by the engine."""
    if init != "checkpoint":
        yield "model.init", (f"{init!r}: BAGEL runs with 'checkpoint' on the vllm_omni engine (vLLM-Omni's BAGEL has no "
                             f"random-weight path; bagel_torch has): use model.init='checkpoint', or the bagel_torch "
                             f"engine for model.init='random'")
    if deploy is not None and deploy not in DEPLOYS:
        yield "rollout.bagel_deploy", f"{deploy!r}: BAGEL runs one of {DEPLOYS} on the vllm_omni engine"
    yield from think_problems(deploy, think)


def think_problems(deploy: str | None, think: bool) -> Iterator[tuple[str, str]]:
    """Think mode (sample.think) against the deployment: the engine checks each request's, the config its own."""
    if deploy == "two_stage" and think:
        yield "rollout.bagel_deploy", ("'two_stage' has no think mode yet (the thinker only prefills): BAGEL's think "
                                       "mode runs in the single-stage deployment only: pass --config.rollout."
                                       "bagel_deploy=single_stage or --config.sample.think=False")
