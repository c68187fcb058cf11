"""Our Qwen-Image-Edit(-Plus) rollout inside vLLM-Omni 0.20: the custom pipeline classes and their request codec.

Qwen-Image's class (`jaxflow_bridge/families/qwen_image/vllm_omni_pipeline.py`: `SamplingLoop`, trajectories, LoRA
in place or merged, its options and load path) built over vLLM-Omni's `QwenImageEditPipeline` or
`QwenImageEditPlusPipeline`, with the edit conditioning of the diffusers engine's pipeline (`EditConditioning`:
the whole Qwen2.5-VL encoder over (reference image(s), instruction) for the prompt and the negative prompt, the
reference images' VAE latents at the sample size, once per prompt). Imports without vLLM-Omni (PEP 562).

How the reference images travel: a request is one prompt with `num_outputs_per_prompt=n`, and its images ride in
the prompt's `multi_modal_data["image"]` (vLLM-Omni's own way for its edit pipelines), as PIL images: once per
prompt, never per sample of its group, one prompt a request (the eval's too: a packed request would carry the other
prompts' images as arrays in its extra_args, which vLLM-Omni's request codec is not known to carry; text-to-image
packs, `qwen.encode_packed`). vLLM-Omni's edit pre-processing (run on every request, by the folder's
`_class_name`) reads them too and adds a resized copy under `additional_information`, which our class leaves unused:
it samples at the request's height and width and encodes the images it was sent, as the diffusers engine does.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxflow_bridge.engines.vllm_omni.fa_version import use_fa3
from jaxflow_bridge.families.qwen_image import vllm_omni_pipeline as qwen
from jaxflow_bridge.families.qwen_image_edit import spec
from jaxflow_bridge.families.qwen_image_edit.diffusers_pipeline import EditConditioning, image_processor
from jaxflow_bridge.rollout.sampling import SamplingParams

PIPELINE_CLASS = f"{__name__}.FlowGRPOQwenImageEditPipeline"
PLUS_PIPELINE_CLASS = f"{__name__}.FlowGRPOQwenImageEditPlusPipeline"
PIPELINE_CLASSES = {"QwenImageEditPipeline": PIPELINE_CLASS, "QwenImageEditPlusPipeline": PLUS_PIPELINE_CLASS}
IMAGES = "image"  # the prompt's multi_modal_data key vLLM-Omni's edit pipelines read


def encode_request(prompt: str, sampling: SamplingParams, seeds, policy_version: int,
                   references=None) -> tuple[dict, dict]:
    """Qwen-Image's request (`qwen.encode_request`) with the prompt's reference images, a uint8 (R, H, W, 3) array,
    in its multi_modal_data as R PIL images; ValueError without them, or for a size vLLM-Omni's edit pre-processing
    would change (`spec.vllm_omni_size_problem`: the engine never samples another size than asked)."""
    from PIL import Image

    size = spec.vllm_omni_size_problem(sampling.height, sampling.width)
    if size is not None:
        raise ValueError(f"vllm_omni engine: {size[1]}")

    if references is None:
        raise ValueError("the edit model needs the prompt's reference images (references), one uint8 "
                         "(R, height, width, 3) array per prompt")
    images = np.asarray(references)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3 or not len(images):
        raise ValueError(f"references: expected uint8 (R, height, width, 3), got {images.dtype} {images.shape}")
    text, kwargs = qwen.encode_request(prompt, sampling, seeds, policy_version)
    return {**text, "multi_modal_data": {IMAGES: [Image.fromarray(im) for im in images]}}, kwargs


def decode_request(prompts: list, params) -> tuple[list[str], SamplingParams, int, list[int], int, list[np.ndarray]]:
    """`qwen.decode_request`'s fields (one prompt: an edit request is never packed) and its reference images back
    as uint8 (R, H, W, 3), in a list of one."""
    images = (prompts[0].get("multi_modal_data") or {}).get(IMAGES) if isinstance(prompts[0], dict) else None
    if not images:
        raise ValueError("an edit rollout request carries its reference images in multi_modal_data['image']")
    images = images if isinstance(images, list) else [images]
    texts, *fields = qwen.decode_request(prompts, params)
    if len(texts) != 1:
        raise ValueError(f"an edit rollout request carries one prompt, got a packed one of {len(texts)}")
    return (texts, *fields, [np.stack([np.asarray(im.convert("RGB")) for im in images])])


class EditRequests(EditConditioning):
    """The edit requests (`decode_request`) and conditioning of our vLLM-Omni pipeline classes: the VL image
    processor is the folder's (`image_processor`, as the diffusers engine's); `plus` is the class's."""

    plus = False

    def setup_requests(self, od_config) -> None:
        self.vl_processor = image_processor(Path(od_config.model))

    read_request = staticmethod(decode_request)


class EditPlusRequests(EditRequests):
    plus = True


def build_pipeline_class(base: type, output_cls, *args, plus: bool = False, **kwargs) -> type:
    """`qwen.build_pipeline_class` over vLLM-Omni's edit pipeline `base` (Edit-Plus's with `plus`), reading edit
    requests; the other arguments are Qwen-Image's."""
    requests, name = ((EditPlusRequests, "FlowGRPOQwenImageEditPlusPipeline") if plus else
                      (EditRequests, "FlowGRPOQwenImageEditPipeline"))
    return qwen.build_pipeline_class(base, output_cls, *args, requests=requests, name=name, **kwargs)


def _pipeline_class(plus: bool) -> type:
    from vllm_omni.diffusion.data import DiffusionOutput
    from vllm_omni.diffusion.lora.layers.base_linear import (
        DiffusionBaseLinearLayerWithLoRA,
    )
    from vllm_omni.diffusion.models.qwen_image.qwen_image_transformer import (
        ColumnParallelApproxGELU,
    )

    if plus:
        from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image_edit_plus import (
            QwenImageEditPlusPipeline as base,
        )
    else:
        from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image_edit import (
            QwenImageEditPipeline as base,
        )
    return build_pipeline_class(base, DiffusionOutput, DiffusionBaseLinearLayerWithLoRA, use_fa3,
                                ColumnParallelApproxGELU, plus=plus)


_LAZY = {"FlowGRPOQwenImageEditPipeline": lambda: _pipeline_class(False),
         "FlowGRPOQwenImageEditPlusPipeline": lambda: _pipeline_class(True)}


def __getattr__(name: str):
    """Build (once) the classes that need vLLM-Omni, when vLLM-Omni's loader asks for them by name."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = _LAZY[name]()
    return value
