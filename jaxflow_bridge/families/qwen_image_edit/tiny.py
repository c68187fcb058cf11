"""A tiny, deterministic, offline Qwen-Image-Edit(-Plus) pipeline folder in diffusers format.

The tiny Qwen-Image's transformer, VAE and Qwen2.5-VL text encoder (`jaxflow_bridge/families/qwen_image/tiny.py`, same
seeds) with a vision tower that sees the reference image, the tokenizer's merges extended by the edit templates'
words, and a Qwen2-VL image processor whose images stay small (at most `MAX_PIXELS`, in `image_processor/`). Loads
with ``QwenImageEditPipeline.from_pretrained`` (or ``QwenImageEditPlusPipeline`` with ``plus=True``), its processor
None; nothing downloaded. Its `processor/` is what vLLM-Omni's edit pipelines load at start
(``Qwen2VLProcessor.from_pretrained(folder, subfolder="processor")``), laid out as the released folder's
(`write_processor`).

CLI: ``python -m jaxflow_bridge.families.qwen_image_edit.tiny --out DIR [--seed 0] [--dtype float32]``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from jaxflow_bridge.families.qwen_image import tiny as base
from jaxflow_bridge.families.qwen_image_edit import spec
from jaxflow_bridge.rollout.model_cache import DTYPES, cached_folder, check_dtype, folder_cli

FORMAT_VERSION = 2  # 2: processor/
# diffusers' QwenImageEditPipeline / QwenImageEditPlusPipeline prompt templates (their prompt_template_encode)
EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new image "
    "that meets the user's requirements while maintaining consistency with the original input where appropriate."
    "<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n")
PLUS_PICTURE = "Picture 1: <|vision_start|><|image_pad|><|vision_end|>"
TEMPLATES = (base.PROMPT_TEMPLATE, EDIT_TEMPLATE, PLUS_PICTURE)
MIN_PIXELS, MAX_PIXELS = spec.TINY_PIXELS  # the VL encoder's image: 1 to 4 merged tokens


def image_processor(min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS):
    """Qwen2-VL's image processor (patches of 14, merged 2 x 2), its images kept tiny by default. The PIL one:
    transformers' `Qwen2VLProcessor` wants torchvision for its video part, so the rollout pipeline expands the image
    tokens itself (`jaxflow_bridge/families/qwen_image_edit/diffusers_pipeline.py`); `processor/` is for vLLM-Omni's
    loader."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)


def write_processor(folder: Path, tokenizer, templates: tuple[str, ...] = TEMPLATES, min_pixels: int = MIN_PIXELS,
                    max_pixels: int = MAX_PIXELS) -> Path:
    """`folder/processor/`, a Qwen2VLProcessor's files as the released Qwen-Image-Edit folder holds them: the
    tokenizer (its fast and slow files), the image processor's preprocessor_config.json (its pixel bounds under the
    released keys too) and the video processor's video_preprocessor_config.json, written as JSON here (transformers'
    video processor needs torchvision to be built). Returns the subfolder."""
    out = Path(folder) / "processor"
    tokenizer.save_pretrained(out)
    base.save_slow_tokenizer_files(out, templates)
    image = {**image_processor(min_pixels, max_pixels).to_dict(), "min_pixels": min_pixels, "max_pixels": max_pixels,
             "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor"}
    (out / "preprocessor_config.json").write_text(json.dumps(image, indent=2) + "\n")
    video = {key: image[key] for key in ("do_convert_rgb", "do_normalize", "do_rescale", "do_resize", "image_mean",
                                         "image_std", "merge_size", "patch_size", "resample", "rescale_factor",
                                         "size", "temporal_patch_size", "min_pixels", "max_pixels",
                                         "processor_class")}
    (out / "video_preprocessor_config.json").write_text(
        json.dumps({**video, "video_processor_type": "Qwen2VLVideoProcessor"}, indent=2) + "\n")
    return out


def build_pipeline(seed: int = 0, dtype: str = "float32", plus: bool = False, transformer_config: dict | None = None,
                   vae=None):
    """The tiny ``QwenImageEditPipeline`` (``QwenImageEditPlusPipeline`` with `plus`) in memory, seeded as the tiny
    Qwen-Image's components are; ``transformer_config`` and a ready ``vae`` replace the tiny ones (the mini edit
    model, experiments/mini_edit)."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = QwenImageTransformer2DModel(**(transformer_config or base.TINY_TRANSFORMER_CONFIG))
        torch.manual_seed(seed + 1)
        vae = vae if vae is not None else AutoencoderKLQwenImage(**base.TINY_VAE_CONFIG)
        torch.manual_seed(seed + 2)
        encoder = base.text_encoder(base.TINY_TEXT_CONFIG, base.TINY_VISION_CONFIG, templates=TEMPLATES)
    for module in (transformer, vae, encoder):
        module.to(DTYPES[dtype])
    return assemble(transformer, vae, encoder, plus)


def assemble(transformer, vae, encoder, plus: bool = False):
    """A ``QwenImageEditPipeline`` (``QwenImageEditPlusPipeline`` with `plus`) of these modules with the real
    scheduler config and the tokenizer of the edit templates, its processor None: the tiny one here, the full-size
    random one (``full_size.py``) and the mini edit folder."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline, QwenImageEditPlusPipeline

    cls = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    return cls(scheduler=FlowMatchEulerDiscreteScheduler(**base.QWEN_SCHEDULER_CONFIG), vae=vae, text_encoder=encoder,
               tokenizer=base.build_tokenizer(TEMPLATES), processor=None, transformer=transformer)


def build_tiny_pipeline(out_dir, seed: int = 0, dtype: str = "float32", plus: bool = False,
                        transformer_config: dict | None = None, vae=None) -> Path:
    """Write the tiny edit pipeline folder to ``out_dir`` (``transformer_config`` and ``vae``: `build_pipeline`'s)."""
    check_dtype(dtype)
    pipe = build_pipeline(seed, dtype, plus, transformer_config, vae)
    out = base.save_folder(pipe, out_dir)
    base.save_slow_tokenizer_files(out / "tokenizer", TEMPLATES)
    image_processor().save_pretrained(out / "image_processor")
    write_processor(out, pipe.tokenizer)
    return out


def tiny_pipeline_path(seed: int = 0, dtype: str = "float32", plus: bool = False) -> Path:
    """The cached tiny edit pipeline folder, built atomically on first use and reused afterwards."""
    check_dtype(dtype)
    name = f"qwen_image_edit{'_plus' if plus else ''}_tiny-v{FORMAT_VERSION}-seed{seed}-{dtype}"
    return cached_folder(name, "model_index.json", lambda tmp: build_tiny_pipeline(tmp, seed, dtype, plus))


def main(argv=None) -> None:
    folder_cli(__doc__, build_tiny_pipeline, argv)


if __name__ == "__main__":
    main()
