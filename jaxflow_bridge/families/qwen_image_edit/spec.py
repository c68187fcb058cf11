"""Qwen-Image-Edit's identity (`model.family='qwen_image_edit'`), read by both sides: Qwen-Image's MMDiT with the
reference images' latents as extra image tokens and a Qwen2.5-VL conditioning over (image, instruction). It builds on
Qwen-Image (`BASE`): the same transformer weights, key map, scheduler and VAE; what differs is named here. Plain
Python: imports neither jax/flax nor torch."""
from __future__ import annotations

import math
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
           one_gpu=False, micro=1)  # 1 sample a micro-batch: an edit row carries the reference image's tokens too, and
# 2 a micro-batch need more than JAX's pool beside vLLM-Omni on one H200 (the compiled step's memory check refuses it)

# The Qwen2.5-VL processor's image bounds (its preprocessor_config.json's min_pixels / max_pixels): the released
# folders' and the tiny folder's (tiny.py writes them; its images stay at 1 to 4 merged tokens)
RELEASED_PIXELS = (56 * 56, 28 * 28 * 16384)
TINY_PIXELS = (28 * 28, 56 * 56)
VISION_PATCH = 28  # pixels a side of one merged vision token: patches of 14, merged 2 x 2
# tokens of the prompt an image adds beyond its merged patches, a bound: Edit-Plus's "Picture k: " label and the
# vision start / end tokens (Edit's one picture is in its template)
PICTURE_TOKENS = 8
# vLLM-Omni 0.20's edit pre-processing rounds the request's height and width down to a multiple of this (2 x the VAE
# factor it reads from vae/config.json's "temporal_downsample", a key diffusers' Qwen-Image VAE config spells
# "temperal_downsample": always its default 8), whatever the folder's VAE
VLLM_OMNI_SIZE_MULTIPLE = 16


def is_folder(folder: Path) -> bool:
    return pipeline_class(folder) in PIPELINE_CLASSES


def vllm_omni_problems(*, init: str, deploy: str | None, think: bool) -> Iterator[tuple[str, str]]:
    """The family's part of the vllm_omni engine's rules: one stage, as Qwen-Image's, so no deployment is chosen."""
    if deploy is not None:
        yield "rollout.bagel_deploy", f"{deploy!r} chooses BAGEL's topology; {LABEL} runs one stage: drop it"


def processor_config(folder: Path) -> dict | None:
    """A folder's image processor preprocessor_config.json (its `image_processor/`'s or, as released folders hold
    it, `processor/`'s), or None without one."""
    import json
    for name in ("image_processor", "processor"):
        path = Path(folder) / name / "preprocessor_config.json"
        if path.is_file():
            return json.loads(path.read_text())
    return None


def pixel_bounds(folder: Path, config: dict | None = None) -> tuple[int, int]:
    """The image processor's bounds (min, max pixels) of a folder (or of its `config`, `processor_config`'s):
    `min_pixels` / `max_pixels`, or (as transformers >= 5 saves them) `size`'s shortest / longest edge;
    RELEASED_PIXELS where the folder says nothing (or is not there yet)."""
    config = processor_config(folder) if config is None else config
    if config is None:
        return RELEASED_PIXELS
    size = config.get("size") or {}
    return (config.get("min_pixels", size.get("shortest_edge", RELEASED_PIXELS[0])),
            config.get("max_pixels", size.get("longest_edge", RELEASED_PIXELS[1])))


def vision_tokens(height: int, width: int, references: int, bounds: tuple[int, int] = RELEASED_PIXELS) -> int:
    """Prompt tokens `references` reference images of `height` x `width` add to the VL prompt beyond its text: per
    image its merged patches as Qwen2-VL's processor (min / max pixels `bounds`) resizes it ((H/28) x (W/28) within
    the bounds: 324 at 512 x 512) and PICTURE_TOKENS."""
    low, high = bounds
    p = VISION_PATCH
    h, w = max(p, round(height / p) * p), max(p, round(width / p) * p)
    if h * w > high:
        scale = math.sqrt(height * width / high)
        h, w = max(p, math.floor(height / scale / p) * p), max(p, math.floor(width / scale / p) * p)
    elif h * w < low:
        scale = math.sqrt(low / (height * width))
        h, w = math.ceil(height * scale / p) * p, math.ceil(width * scale / p) * p
    return references * ((h // p) * (w // p) + PICTURE_TOKENS)


def vllm_omni_size_problem(height: int, width: int) -> tuple[str, str] | None:
    """(config key, message) when vLLM-Omni's edit pre-processing would sample another size than `height` x `width`
    (not multiples of VLLM_OMNI_SIZE_MULTIPLE), naming the nearest sizes that work; None when it samples that size."""
    m = VLLM_OMNI_SIZE_MULTIPLE
    if height % m == 0 and width % m == 0:
        return None
    key = "sample.height" if height % m else "sample.width"
    near = sorted({(max(m, h), max(m, w)) for h in (height // m * m, -(-height // m) * m)
                   for w in (width // m * m, -(-width // m) * m)})
    listed = ", ".join(f"{h}x{w}" for h, w in near)
    return key, (f"{height}x{width} (sample.height x sample.width): {LABEL} on the vllm_omni engine samples multiples "
                 f"of {m} (vLLM-Omni 0.20's edit pre-processing rounds other sizes down); use one of {listed}")
