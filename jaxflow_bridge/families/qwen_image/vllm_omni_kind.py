"""Qwen-Image on the vllm_omni engine, the engine process's side (`engines/vllm_omni/kinds.py` picks it by the
model folder): our FlowGRPOQwenImagePipeline's arguments and options, vLLM-Omni's default stage, the sampling
parameters and request codec, the base weights' fingerprint, the image size multiple and the adapter's names."""
from __future__ import annotations

from pathlib import Path

from jaxflow_bridge.contract.lora import to_vllm_omni
from jaxflow_bridge.families.qwen_image import spec
from jaxflow_bridge.families.qwen_image import vllm_omni_pipeline as qwen_pipeline
from jaxflow_bridge.rollout.fingerprint import stored_fingerprint
from jaxflow_bridge.rollout.sampling import SamplingParams


def tiny_folder(dtype: str) -> Path:
    """The cached tiny Qwen-Image folder saved in `dtype`."""
    from jaxflow_bridge.families.qwen_image.tiny import tiny_pipeline_path

    return tiny_pipeline_path(dtype=dtype)


class VllmOmniKind:
    """A diffusers Qwen-Image folder: our FlowGRPOQwenImagePipeline with its options, vLLM-Omni's default stage."""

    name = spec.NAME
    stages = 1  # vLLM-Omni's default: one diffusion stage
    stage_layout = "Qwen-Image: vLLM-Omni's default, one diffusion stage"  # named when another count starts
    sampling = SamplingParams
    encode_request = staticmethod(qwen_pipeline.encode_request)
    encode_packed = staticmethod(qwen_pipeline.encode_packed)  # several prompts of one sample each in one request

    def __init__(self, folder: Path, deploy: str | None = None):  # deploy: None (the engine's rules refuse one)
        self.folder = folder
        self.size_multiple = spec.size_multiple(folder)

    def pipeline_args(self, config: dict) -> dict:
        """custom_pipeline_args: the class, its options (`vllm_omni.pipeline.pipeline_options`) and `random_seed`."""
        options = {k: config[k] for k in qwen_pipeline.PIPELINE_OPTIONS if k in config}
        args = {"pipeline_class": qwen_pipeline.PIPELINE_CLASS, **qwen_pipeline.pipeline_options(options)}
        if config.get("random_seed") is not None:
            args["random_seed"] = int(config["random_seed"])
        return args

    def start_args(self, pipeline_args: dict, extension: str) -> dict:
        """AsyncOmni's keywords for our pipeline and worker extension."""
        return {"custom_pipeline_args": pipeline_args, "worker_extension_cls": extension}

    def thinker_params(self, sampling) -> list:
        return []

    def fingerprint(self) -> str:
        return stored_fingerprint(*spec.fingerprint_files(self.folder))

    def adapter(self, tensors: dict) -> dict:
        return to_vllm_omni(tensors)
