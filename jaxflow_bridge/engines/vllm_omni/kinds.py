"""The model kinds the vllm_omni engine serves (docs/bagel.md §7 (d)), told apart by the model folder: Qwen-Image (a
diffusers folder, `model_index.json`; or "tiny") and BAGEL (config.json's `model_type` "bagel"; or "tiny_bagel").

A kind gives the engine what differs between them: the custom pipeline's arguments (its class and options, the
options it refuses), AsyncOmni's start arguments and stage count (BAGEL: one stage, or a thinker before the DiT),
the thinker's sampling parameters, the base weights' fingerprint, the image size multiple, the
sampling parameters and request codec, and the adapter's tensor names as vLLM-Omni binds them. Our pipeline,
`RolloutWorkerExtension` and output codec run on the (last) diffusion stage. Imports no vLLM-Omni until BAGEL's start
arguments look up its deploy file.
"""
from __future__ import annotations

import json
from pathlib import Path

from jaxflow_bridge.families.bagel.keymap import IGNORED_PREFIXES, generation_expert_adapter
from jaxflow_bridge.contract.lora import to_vllm_omni
from jaxflow_bridge.contract.schedule import pixels_per_token
from jaxflow_bridge.families.bagel import vllm_omni_pipeline as bagel_pipeline
from jaxflow_bridge.families.qwen_image import vllm_omni_pipeline as qwen_pipeline
from jaxflow_bridge.families.bagel.sampling import BagelSamplingParams
from jaxflow_bridge.families.qwen_image.diffusers_pipeline import stored_fingerprint
from jaxflow_bridge.rollout.sampling import SamplingParams

# vLLM-Omni 0.20's BAGEL topologies inside the installed package: "single_stage", one DiT stage doing prefill,
# denoising and decode; "two_stage", a thinker (vLLM's AR engine: the prompt's prefill, its KV sent to stage 1) and
# the DiT (docs/bagel.md §3). Without a deploy file a BAGEL folder starts the two-stage one.
BAGEL_DEPLOY_FILES = {"single_stage": ("deploy", "bagel_single_stage.yaml"), "two_stage": ("deploy", "bagel.yaml")}
BAGEL_DEPLOY_FILE = BAGEL_DEPLOY_FILES["single_stage"]


class QwenImage:
    """A diffusers Qwen-Image folder: our FlowGRPOQwenImagePipeline with its options, vLLM-Omni's default stage."""

    name = "qwen_image"
    stages = 1  # vLLM-Omni's default: one diffusion stage
    sampling = SamplingParams
    encode_request = staticmethod(qwen_pipeline.encode_request)

    def __init__(self, folder: Path):
        self.folder = folder
        self.size_multiple = pixels_per_token(json.loads((folder / "vae" / "config.json").read_text()))

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
        return stored_fingerprint(self.folder / "transformer")

    def adapter(self, tensors: dict) -> dict:
        return to_vllm_omni(tensors)


class Bagel:
    """A BAGEL folder: our FlowGRPOBagelPipeline in vLLM-Omni's single-stage deployment, LoRA on the generation
    expert through vLLM-Omni's own per-slice apply."""

    name = "bagel"
    sampling = BagelSamplingParams
    QWEN_ONLY = ("qk_ops", "fa_version", "gelu", "cfg_forward")  # options of FlowGRPOQwenImagePipeline alone

    def __init__(self, folder: Path, deploy: str = "single_stage"):
        if deploy not in BAGEL_DEPLOY_FILES:
            raise ValueError(f"vllm_omni engine: deploy={deploy!r}; BAGEL runs one of {tuple(BAGEL_DEPLOY_FILES)}")
        self.folder, self.deploy, self.stages = folder, deploy, 1 if deploy == "single_stage" else 2
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

    def start_args(self, pipeline_args: dict, extension: str) -> dict:
        """`deploy_config` (AsyncOmni's keyword; the file's own comment says `deploy_config_path`, which nothing
        reads): the installed vLLM-Omni's BAGEL file of `deploy`; our pipeline and extension on the DiT stage (two
        stages: vLLM-Omni's per-stage `stage_1_*` keywords, so the thinker stays vLLM-Omni's own). FileNotFoundError
        if that vLLM-Omni has no such file."""
        import vllm_omni

        path = Path(vllm_omni.__file__).parent.joinpath(*BAGEL_DEPLOY_FILES[self.deploy])
        if not path.is_file():
            raise FileNotFoundError(f"vllm_omni engine: {path} is missing: BAGEL's deploy={self.deploy!r} needs "
                                    f"vLLM-Omni 0.20's deploy file")
        prefix = "" if self.stages == 1 else f"stage_{self.stages - 1}_"
        return {"deploy_config": str(path), f"{prefix}custom_pipeline_args": pipeline_args,
                f"{prefix}worker_extension_cls": extension}

    def encode_request(self, prompt: str, sampling: BagelSamplingParams, seeds, policy_version: int):
        """`engines.vllm_omni.bagel_pipeline.encode_request`, the prompt framed for the thinker with two stages."""
        return bagel_pipeline.encode_request(prompt, sampling, seeds, policy_version, framed=self.stages > 1)

    def thinker_params(self, sampling: BagelSamplingParams) -> list:
        """The thinker's sampling parameters (vLLM's SamplingParams keywords) before the DiT's, two stages only: one
        greedy token, the prompt's KV sent when its prefill ends (`bagel.yaml`'s transfer criterion). ValueError for
        think mode, which two stages do not run yet."""
        if self.stages == 1:
            return []
        if sampling.think:
            raise ValueError("vllm_omni engine: BAGEL's think mode runs in the single-stage deployment only: pass "
                             "rollout.bagel_deploy='single_stage' or sample.think=False")
        return [{"max_tokens": 1, "temperature": 0.0}]

    def fingerprint(self) -> str:
        """ema.safetensors without the trainer-ignored prefixes: the bagel_torch engine's and the trainer's."""
        return stored_fingerprint(self.folder, "ema.safetensors", IGNORED_PREFIXES)

    def adapter(self, tensors: dict) -> dict:
        """BAGEL's checkpoint module names (vLLM-Omni binds them relative to its `bagel` component); adapters off
        the generation expert refused (`bagel_keymap.generation_expert_adapter`)."""
        return to_vllm_omni(generation_expert_adapter(tensors))


def model_kind(model: str, dtype: str, deploy: str | None = None):
    """The kind serving `model` (a folder, "tiny" or "tiny_bagel": the cached tiny folders saved in `dtype`), BAGEL
    in its `deploy` topology (default "single_stage"); ValueError in one line for a folder of neither kind, or a
    deploy given for Qwen-Image."""
    folder = Path(model)
    if model == "tiny":
        from jaxflow_bridge.families.qwen_image.tiny import tiny_pipeline_path

        folder = tiny_pipeline_path(dtype=dtype)
    elif model == "tiny_bagel":
        from jaxflow_bridge.families.bagel.tiny import tiny_bagel_path

        return Bagel(tiny_bagel_path(dtype=dtype), deploy or "single_stage")
    config = folder / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("model_type") == "bagel":
        return Bagel(folder, deploy or "single_stage")
    if (folder / "model_index.json").is_file():
        if deploy is not None:
            raise ValueError(f"vllm_omni engine: deploy={deploy!r} chooses BAGEL's topology; Qwen-Image runs one "
                             f"stage: drop it")
        return QwenImage(folder)
    raise ValueError(f"vllm_omni engine: {folder} is neither a diffusers Qwen-Image folder (model_index.json) nor a "
                     f"BAGEL folder (config.json with model_type 'bagel')")
