"""Qwen-Image-Edit(-Plus) on the vllm_omni engine, the engine process's side (`engines/vllm_omni/kinds.py` picks it
by the model folder): Qwen-Image's kind with the edit pipeline class the folder's `_class_name` calls for and the
request codec that carries the prompt's reference images."""
from __future__ import annotations

from pathlib import Path

from jaxflow_bridge.families.qwen_image.vllm_omni_kind import VllmOmniKind as QwenImageKind
from jaxflow_bridge.families.qwen_image_edit import spec
from jaxflow_bridge.families.qwen_image_edit import vllm_omni_pipeline as edit_pipeline


def tiny_folder(dtype: str) -> Path:
    """The cached tiny Qwen-Image-Edit folder saved in `dtype`."""
    from jaxflow_bridge.families.qwen_image_edit.tiny import tiny_pipeline_path

    return tiny_pipeline_path(dtype=dtype)


class VllmOmniKind(QwenImageKind):
    """A diffusers Qwen-Image-Edit(-Plus) folder: our edit pipeline class over vLLM-Omni's, Qwen-Image's options."""

    name = spec.NAME
    stage_layout = "Qwen-Image-Edit: vLLM-Omni's default, one diffusion stage"
    encode_request = staticmethod(edit_pipeline.encode_request)  # its `references`: the prompt's images
    encode_packed = None  # one prompt a request, the eval's too (its images: edit_pipeline's module docstring)

    def pipeline_args(self, config: dict) -> dict:
        """Qwen-Image's custom_pipeline_args with the edit class of the folder's pipeline (Edit or Edit-Plus)."""
        return {**super().pipeline_args(config),
                "pipeline_class": edit_pipeline.PIPELINE_CLASSES[spec.pipeline_class(self.folder)]}
