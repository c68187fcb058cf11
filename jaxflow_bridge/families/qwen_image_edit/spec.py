"""Qwen-Image-Edit's identity (`model.family='qwen_image_edit'`), read by both sides: Qwen-Image's MMDiT with the
reference images' latents as extra image tokens and a Qwen2.5-VL conditioning over (image, instruction). It builds on
Qwen-Image (`BASE`): the same transformer weights, key map, scheduler and VAE; what differs is named here. Plain
Python: imports neither jax/flax nor torch."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from jaxflow_bridge.families.qwen_image.spec import (  # noqa: F401  (the base family's, re-exported)
    LORA_COMPONENT, MARKER, SCHEDULER_CONFIG, WEIGHTS, fingerprint_files, pipeline_class, pixels_per_token,
    size_multiple)

NAME = "qwen_image_edit"
BASE = "qwen_image"  # the family whose spec and key map this one's build on (tests/families/test_family_slices.py)
LABEL = "Qwen-Image-Edit"
TINY = "tiny_edit"  # model.path / engine `model` of the cached tiny offline Qwen-Image-Edit
FOLDER = "a diffusers Qwen-Image-Edit(-Plus) folder (model_index.json)"
# Edit: one reference image; Edit-Plus: one or more (its VL prompt numbers them "Picture k: ...")
PIPELINE_CLASSES = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline")
ENGINES = ("diffusers", "vllm_omni")  # the rollout engines that serve it
EXAMPLE = "/path/to/Qwen-Image-Edit (a diffusers folder)"
# `jaxflow_bench.e2e --recipe qwen_image_edit` (as Qwen-Image's spec.E2E): the edit recipe on a random full-size edit
# folder (Qwen-Image's transformer, drawn on the devices; the VL encoder at Qwen2.5-VL-7B's size; processor/)
E2E = dict(config="configs/qwen_edit_ocr.py", folder="/tmp/qwen_edit_random", marker="model_index.json",
           writer=["scripts/make_random_pipeline.py", "--family", NAME, "--no-transformer-weights"], init="random",
           one_gpu=False)


def is_folder(folder: Path) -> bool:
    return pipeline_class(folder) in PIPELINE_CLASSES


def vllm_omni_problems(*, init: str, deploy: str | None, think: bool) -> Iterator[tuple[str, str]]:
    """The family's part of the vllm_omni engine's rules: one stage, as Qwen-Image's, so no deployment is chosen."""
    if deploy is not None:
        yield "rollout.bagel_deploy", f"{deploy!r} chooses BAGEL's topology; {LABEL} runs one stage: drop it"
