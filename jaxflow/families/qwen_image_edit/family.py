"""Qwen-Image-Edit (`model.family='qwen_image_edit'`): a diffusers Qwen-Image-Edit(-Plus) folder (or "tiny_edit"),
engines diffusers and vllm_omni; Qwen-Image's family (`jaxflow/families/qwen_image/family.py`: the same transformer weights, loading,
LoRA and checks) with what differs: its model reads the reference images' latents (`transformer.py`), its objective
the trajectory's `reference_latents` (`objective.py`). Its identity is `jaxflow_bridge/families/qwen_image_edit/spec.py`."""
from __future__ import annotations

from pathlib import Path

from jaxflow.algorithms.objective import Objective
from jaxflow.families.qwen_image.family import QwenImage
from jaxflow.families.qwen_image_edit.objective import EDIT_WINDOW
from jaxflow.families.qwen_image_edit.transformer import QwenImageEditTransformer
from jaxflow_bridge.families.qwen_image_edit import spec

REFERENCES = 1  # reference images a sample is conditioned on (Edit: one; Edit-Plus takes several)


class QwenImageEdit(QwenImage):
    name = spec.NAME
    engines = spec.ENGINES
    auto_lora_apply = QwenImage.auto_lora_apply
    tiny = spec.TINY
    tiny_config = "configs/qwen_edit_ocr.py:tiny (the tiny offline edit model)"
    example = spec.EXAMPLE
    model_type = QwenImageEditTransformer

    def folder(self, cfg) -> Path:
        if cfg.model.path == self.tiny:
            from jaxflow_bridge.families.qwen_image_edit.tiny import tiny_pipeline_path
            return tiny_pipeline_path(dtype=cfg.rollout.dtype)
        return Path(cfg.model.path)

    def size_multiple(self, cfg) -> int:
        if cfg.model.path == self.tiny:  # the tiny Qwen-Image's VAE
            from jaxflow_bridge.families.qwen_image.tiny import TINY_VAE_CONFIG
            return spec.pixels_per_token(TINY_VAE_CONFIG)
        return super().size_multiple(cfg)

    def problems(self, cfg):
        """Qwen-Image's, and on the vllm_omni engine the sizes its edit pre-processing samples as they are."""
        yield from super().problems(cfg)
        if cfg.rollout.engine == "vllm_omni" and (found := spec.vllm_omni_size_problem(cfg.sample.height,
                                                                                       cfg.sample.width)):
            yield found

    def vision_tokens(self, cfg) -> int:
        """The reference images' tokens in the VL prompt (`spec.vision_tokens` at the sample size, the images being
        resized to it, within the folder's processor bounds: `spec.pixel_bounds`; the tiny folder's for the tiny
        model)."""
        bounds = spec.TINY_PIXELS if cfg.model.path == self.tiny else spec.pixel_bounds(Path(cfg.model.path))
        return spec.vision_tokens(cfg.sample.height, cfg.sample.width, REFERENCES, bounds)

    def image_tokens(self, folder: Path, cfg) -> int:
        """The target's latent grid and each reference image's, resized to the sample size (`transformer.py`)."""
        return super().image_tokens(folder, cfg) * (1 + REFERENCES)

    def objective(self, config) -> Objective:
        """Qwen-Image's window log-prob with the batch's reference latents (`objective.EDIT_WINDOW`)."""
        return EDIT_WINDOW

    def batch_shape(self, model) -> dict:
        return {**super().batch_shape(model), "references": REFERENCES}
