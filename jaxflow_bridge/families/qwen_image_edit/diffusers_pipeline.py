"""Our Qwen-Image-Edit(-Plus) rollout pipeline on diffusers components: Qwen-Image's (`jaxflow_bridge/families/qwen_image/
diffusers_pipeline.py`: sampling loop, trajectories, LoRA) conditioned as diffusers' QwenImageEdit(Plus)Pipeline is,
once per prompt and never per sample of its group: the Qwen2.5-VL encoder over (reference image(s), instruction) for
the prompt and for the negative prompt, and the reference images' VAE latents (packed as the target's, at the sample
size), which the transformer reads as extra image tokens and the trajectory carries (`reference_latents`). Never
imports JAX."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from jaxflow_bridge.families.qwen_image import diffusers_pipeline as base
from jaxflow_bridge.families.qwen_image_edit import spec

IMAGE_PAD = "<|image_pad|>"
PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"  # Edit-Plus numbers its images in the prompt


def tiny_folder() -> Path:
    """The cached tiny Qwen-Image-Edit folder (float32) the diffusers engine serves for model "tiny_edit"."""
    from jaxflow_bridge.families.qwen_image_edit.tiny import tiny_pipeline_path

    return tiny_pipeline_path()


class EditConditioning:
    """The edit conditioning of a Qwen-Image `SamplingLoop` (this module's `RolloutPipeline`, and the vLLM-Omni
    pipeline class, `vllm_omni_pipeline.py`): it needs `plus` (Edit-Plus's numbered pictures) and `vl_processor`
    (`image_processor`) beside the loop's components."""

    text_model = staticmethod(lambda encoder: encoder)  # the whole VL model: it sees the reference images

    def conditioning(self, prompts: list[str], sp, references=None):
        """Per prompt its VL embeds over (its images, instruction) and over (its images, negative prompt), and its
        (R, S, C) reference latents: one VL pass over all of them and one VAE pass over every reference image."""
        refs = self.check_references(references, len(prompts), sp.height, sp.width)
        texts = list(prompts) + ([sp.negative_prompt] * len(prompts) if sp.guided else [])
        embeds = self.encode_with_images(texts, [*refs, *refs] if sp.guided else refs)
        latents = self.reference_latents(np.concatenate(refs))
        latents = latents.reshape(len(prompts), -1, *latents.shape[1:])
        return embeds[: len(prompts)], (embeds[len(prompts):] or None), latents

    @staticmethod
    def check_references(references, prompts: int, height: int, width: int) -> list[np.ndarray]:
        """ValueError unless `references` holds one uint8 (R, height, width, 3) array per prompt, R >= 1."""
        if references is None or len(references) != prompts:
            raise ValueError(f"the edit model needs one reference image array per prompt ({prompts}), got "
                             f"{'none' if references is None else len(references)}")
        out = [np.asarray(r) for r in references]
        for i, r in enumerate(out):
            if r.dtype != np.uint8 or r.ndim != 4 or r.shape[0] < 1 or r.shape[1:] != (height, width, 3):
                raise ValueError(f"references[{i}]: expected uint8 (R, {height}, {width}, 3) (the sample size), got "
                                 f"{r.dtype} {r.shape}")
        return out

    @torch.inference_mode()
    def encode_with_images(self, texts: list[str], images: list[np.ndarray]) -> list[torch.Tensor]:
        """One VL-encoder pass: per text its (L_i, D) last hidden states, template dropped, the text seeing its
        images (uint8 (R, H, W, 3)): Qwen2-VL's image tokens expanded to each image's merged patch count."""
        from PIL import Image

        pictures = [[Image.fromarray(im) for im in group] for group in images]
        if self.plus:
            texts = ["".join(PICTURE.format(k + 1) for k in range(len(g))) + t for t, g in zip(texts, pictures)]
        elif any(len(g) != 1 for g in pictures):
            raise ValueError("Qwen-Image-Edit takes one reference image per prompt (Edit-Plus takes several)")
        prompts = [self.template.format(t) for t in texts]
        vision = self.vl_processor(images=[p for g in pictures for p in g], return_tensors="pt")
        counts = iter((vision["image_grid_thw"].prod(-1) // self.vl_processor.merge_size ** 2).tolist())
        prompts = [re.sub(re.escape(IMAGE_PAD), lambda _: IMAGE_PAD * next(counts), p) for p in prompts]
        tok = self.tokenizer(prompts, padding=True, return_tensors="pt")
        ids, mask = tok.input_ids.to(self.device), tok.attention_mask.to(self.device)
        hidden = self.text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True,
                                   pixel_values=vision["pixel_values"].to(self.device, self.text_encoder.dtype),
                                   image_grid_thw=vision["image_grid_thw"].to(self.device)).hidden_states[-1]
        return [h[m.bool()][self.drop:].to(self.dtype) for h, m in zip(hidden, mask)]

    @torch.inference_mode()
    def reference_latents(self, images: np.ndarray) -> torch.Tensor:
        """uint8 (N, H, W, 3) -> float32 (N, S, C): the VAE's latents (their mode), normalised by its statistics and
        packed 2 x 2 as the target's (diffusers' `_encode_vae_image` and `_pack_latents`)."""
        x = torch.from_numpy(images).to(self.device, self.vae.dtype).permute(0, 3, 1, 2)[:, :, None] / 127.5 - 1
        z = self.vae.encode(x).latent_dist.mode()[:, :, 0].float()
        c = self.vae.config
        mean, std = (torch.tensor(c[k], device=z.device).view(1, -1, 1, 1) for k in ("latents_mean", "latents_std"))
        z = (z - mean) / std
        b, ch, h, w = z.shape
        return z.view(b, ch, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), ch * 4)


class RolloutPipeline(EditConditioning, base.RolloutPipeline):
    """Edit sampling with trajectories on the components of a diffusers QwenImageEdit(Plus)Pipeline; the VL image
    processor is the folder's `image_processor/` (or `processor/`)."""

    @classmethod
    def diffusers_pipeline(cls, path, **kw):
        import diffusers

        name = spec.pipeline_class(Path(path))
        if name not in spec.PIPELINE_CLASSES:
            raise ValueError(f"{path}: model_index.json names {name!r}, not one of {spec.PIPELINE_CLASSES}")
        return getattr(diffusers, name).from_pretrained(path, processor=None, **kw)

    def __init__(self, pipe, device="cpu", model_path: str | None = None, lora_apply: str = "layers"):
        super().__init__(pipe, device, model_path, lora_apply)
        self.plus = type(pipe).__name__ == "QwenImageEditPlusPipeline"
        self.vl_processor = image_processor(Path(model_path)) if model_path else None


def image_processor(folder: Path):
    """The folder's Qwen2-VL image processor (`image_processor/`, or a released folder's `processor/`), within the
    folder's pixel bounds (`spec.pixel_bounds`)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = spec.processor_config(folder)
    if config is None:
        raise FileNotFoundError(f"{folder} has no image_processor/ nor processor/ preprocessor_config.json")
    keep = {k: config[k] for k in ("patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std")
            if k in config}
    low, high = spec.pixel_bounds(folder, config)
    return Qwen2VLImageProcessorPil(min_pixels=low, max_pixels=high, **keep)
