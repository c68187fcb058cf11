"""The model kinds the vllm_omni engine serves (docs/bagel.md §7 (d)), told apart by the model folder: Qwen-Image (a
diffusers folder, `model_index.json`; or "tiny") and BAGEL (config.json's `model_type` "bagel"; or "tiny_bagel").

A kind gives the engine what differs between them: the custom pipeline's arguments (its class and options, the
options it refuses), AsyncOmni's extra start arguments, the base weights' fingerprint, the image size multiple, the
sampling parameters and request codec, and the adapter's tensor names as vLLM-Omni binds them. Both serve one
diffusion stage, our `RolloutWorkerExtension` and the same output codec. Imports no vLLM-Omni until BAGEL's start
arguments look up its deploy file.
"""
from __future__ import annotations

import json
from pathlib import Path

from jaxflow_bridge.contract.bagel_keymap import IGNORED_PREFIXES, generation_expert_adapter
from jaxflow_bridge.contract.lora import to_vllm_omni
from jaxflow_bridge.contract.schedule import pixels_per_token
from jaxflow_bridge.rollout import vllm_omni_bagel_pipeline as bagel_pipeline
from jaxflow_bridge.rollout import vllm_omni_pipeline as qwen_pipeline
from jaxflow_bridge.rollout.bagel_sampling import BagelSamplingParams
from jaxflow_bridge.rollout.pipeline import stored_fingerprint
from jaxflow_bridge.rollout.sampling import SamplingParams

# vLLM-Omni 0.20's single-stage BAGEL topology (one DiT stage doing prefill, denoising and decode), inside the
# installed package; without it a BAGEL folder starts the two-stage `deploy/bagel.yaml`
BAGEL_DEPLOY_FILE = ("deploy", "bagel_single_stage.yaml")


class QwenImage:
    """A diffusers Qwen-Image folder: our FlowGRPOQwenImagePipeline with its options, vLLM-Omni's default stage."""

    name = "qwen_image"
    sampling = SamplingParams
    encode_request = staticmethod(qwen_pipeline.encode_request)

    def __init__(self, folder: Path):
        self.folder = folder
        self.size_multiple = pixels_per_token(json.loads((folder / "vae" / "config.json").read_text()))

    def pipeline_args(self, config: dict) -> dict:
        """custom_pipeline_args: the class, its options (`vllm_omni_pipeline.pipeline_options`) and `random_seed`."""
        options = {k: config[k] for k in qwen_pipeline.PIPELINE_OPTIONS if k in config}
        args = {"pipeline_class": qwen_pipeline.PIPELINE_CLASS, **qwen_pipeline.pipeline_options(options)}
        if config.get("random_seed") is not None:
            args["random_seed"] = int(config["random_seed"])
        return args

    def start_args(self) -> dict:
        return {}

    def fingerprint(self) -> str:
        return stored_fingerprint(self.folder / "transformer")

    def adapter(self, tensors: dict) -> dict:
        return to_vllm_omni(tensors)


class Bagel:
    """A BAGEL folder: our FlowGRPOBagelPipeline in vLLM-Omni's single-stage deployment, LoRA on the generation
    expert through vLLM-Omni's own per-slice apply."""

    name = "bagel"
    sampling = BagelSamplingParams
    encode_request = staticmethod(bagel_pipeline.encode_request)
    QWEN_ONLY = ("qk_ops", "fa_version", "gelu", "cfg_forward")  # options of FlowGRPOQwenImagePipeline alone

    def __init__(self, folder: Path):
        self.folder = folder
        top = json.loads((folder / "config.json").read_text())
        self.size_multiple = top["vae_config"]["downsample"] * top["latent_patch_size"]

    def pipeline_args(self, config: dict) -> dict:
        """custom_pipeline_args: the class alone; ValueError (one line, naming the fix) for what BAGEL lacks."""
        given = [k for k in self.QWEN_ONLY if k in config]
        if given:
            raise ValueError(f"vllm_omni engine: {', '.join(given)} configure(s) the Qwen-Image pipeline only; "
                             f"drop them for a BAGEL model")
        if config.get("lora_apply", "stock") != "stock":
            raise ValueError(f"vllm_omni engine: lora_apply={config['lora_apply']!r} is Qwen-Image's; BAGEL's LoRA "
                             f"runs vLLM-Omni's per-slice apply: pass lora_apply='stock' (rollout.lora_mode='layers')")
        if config.get("random_seed") is not None:
            raise ValueError("vllm_omni engine: BAGEL has no random-weight path in vLLM-Omni yet: use "
                             "model.init='checkpoint', or the bagel_torch engine for model.init='random'")
        return {"pipeline_class": bagel_pipeline.PIPELINE_CLASS}

    def start_args(self) -> dict:
        """`deploy_config` (AsyncOmni's keyword; the file's own comment says `deploy_config_path`, which nothing
        reads): the installed vLLM-Omni's single-stage BAGEL file. FileNotFoundError if that vLLM-Omni has none."""
        import vllm_omni

        path = Path(vllm_omni.__file__).parent.joinpath(*BAGEL_DEPLOY_FILE)
        if not path.is_file():
            raise FileNotFoundError(f"vllm_omni engine: {path} is missing: BAGEL needs vLLM-Omni 0.20's single-stage "
                                    f"deploy file")
        return {"deploy_config": str(path)}

    def fingerprint(self) -> str:
        """ema.safetensors without the trainer-ignored prefixes: the bagel_torch engine's and the trainer's."""
        return stored_fingerprint(self.folder, "ema.safetensors", IGNORED_PREFIXES)

    def adapter(self, tensors: dict) -> dict:
        """BAGEL's checkpoint module names (vLLM-Omni binds them relative to its `bagel` component); adapters off
        the generation expert refused (`bagel_keymap.generation_expert_adapter`)."""
        return to_vllm_omni(generation_expert_adapter(tensors))


def model_kind(model: str, dtype: str):
    """The kind serving `model` (a folder, "tiny" or "tiny_bagel": the cached tiny folders saved in `dtype`);
    ValueError in one line for a folder of neither kind."""
    if model == "tiny":
        from jaxflow_bridge.rollout.tiny import tiny_pipeline_path

        return QwenImage(tiny_pipeline_path(dtype=dtype))
    if model == "tiny_bagel":
        from jaxflow_bridge.rollout.tiny_bagel import tiny_bagel_path

        return Bagel(tiny_bagel_path(dtype=dtype))
    folder = Path(model)
    config = folder / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("model_type") == "bagel":
        return Bagel(folder)
    if (folder / "model_index.json").is_file():
        return QwenImage(folder)
    raise ValueError(f"vllm_omni engine: {folder} is neither a diffusers Qwen-Image folder (model_index.json) nor a "
                     f"BAGEL folder (config.json with model_type 'bagel')")
