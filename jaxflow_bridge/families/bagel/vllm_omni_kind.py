"""BAGEL on the vllm_omni engine, the engine process's side (`engines/vllm_omni/kinds.py` picks it by the model
folder, docs/bagel.md §7 (d)): our FlowGRPOBagelPipeline's arguments and the options it refuses, AsyncOmni's start
arguments and stage count (one stage, or a thinker before the DiT), the thinker's sampling parameters, the
sampling parameters and request codec, the base weights' fingerprint, the image size multiple and the adapter's
names as vLLM-Omni binds them. Imports no vLLM-Omni until its start arguments look up the deploy file."""
from __future__ import annotations

from pathlib import Path

from jaxflow_bridge.contract.lora import to_vllm_omni
from jaxflow_bridge.engines.vllm_omni.rules import refuse
from jaxflow_bridge.families.bagel import spec
from jaxflow_bridge.families.bagel import vllm_omni_pipeline as bagel_pipeline
from jaxflow_bridge.families.bagel.keymap import generation_expert_adapter
from jaxflow_bridge.families.bagel.sampling import BagelSamplingParams
from jaxflow_bridge.rollout.fingerprint import stored_fingerprint


def tiny_folder(dtype: str) -> Path:
    """The cached tiny random BAGEL folder saved in `dtype`."""
    from jaxflow_bridge.families.bagel.tiny import tiny_bagel_path

    return tiny_bagel_path(dtype=dtype)


class VllmOmniKind:
    """A BAGEL folder: our FlowGRPOBagelPipeline in vLLM-Omni's single-stage deployment, LoRA on the generation
    expert through vLLM-Omni's own per-slice apply."""

    name = spec.NAME
    sampling = BagelSamplingParams
    stage_layout = "BAGEL: deploy/bagel_single_stage.yaml for one, deploy/bagel.yaml for the thinker and the DiT"
    encode_packed = None  # one prompt a request, the eval's too: our BAGEL pipeline reads one prompt a request
    QWEN_ONLY = ("qk_ops", "fa_version", "gelu", "cfg_forward")  # options of FlowGRPOQwenImagePipeline alone

    def __init__(self, folder: Path, deploy: str | None = None):
        deploy = deploy or "single_stage"  # one of spec.DEPLOYS (the engine's rules, `spec.vllm_omni_problems`)
        self.folder, self.deploy, self.stages = folder, deploy, 1 if deploy == "single_stage" else 2
        self.size_multiple = spec.size_multiple(folder)

    def pipeline_args(self, config: dict) -> dict:
        """custom_pipeline_args: the class alone; ValueError (one line, naming the fix) for the Qwen-Image pipeline's
        options (what a run's config cannot ask of BAGEL is refused before, by the engine's rules)."""
        given = [k for k in self.QWEN_ONLY if k in config]
        if given:
            raise ValueError(f"vllm_omni engine: {', '.join(given)} configure(s) the Qwen-Image pipeline only; "
                             f"drop them for a BAGEL model")
        if config.get("lora_apply", "folder") != "folder":
            raise ValueError(f"vllm_omni engine: lora_apply={config['lora_apply']!r} is Qwen-Image's; BAGEL's LoRA "
                             f"runs vLLM-Omni's own apply: pass lora_apply='folder' (rollout.lora_apply='auto')")
        return {"pipeline_class": bagel_pipeline.PIPELINE_CLASS}

    def start_args(self, pipeline_args: dict, extension: str) -> dict:
        """`deploy_config` (AsyncOmni's keyword; the file's own comment says `deploy_config_path`, which nothing
        reads): the installed vLLM-Omni's BAGEL file of `deploy`; our pipeline and extension on the DiT stage (two
        stages: vLLM-Omni's per-stage `stage_1_*` keywords, so the thinker stays vLLM-Omni's own). FileNotFoundError
        if that vLLM-Omni has no such file."""
        import vllm_omni

        path = Path(vllm_omni.__file__).parent.joinpath(*spec.DEPLOY_FILES[self.deploy])
        if not path.is_file():
            raise FileNotFoundError(f"vllm_omni engine: {path} is missing: BAGEL's deploy={self.deploy!r} needs "
                                    f"vLLM-Omni 0.20's deploy file")
        prefix = "" if self.stages == 1 else f"stage_{self.stages - 1}_"
        return {"deploy_config": str(path), f"{prefix}custom_pipeline_args": pipeline_args,
                f"{prefix}worker_extension_cls": extension}

    def encode_request(self, prompt: str, sampling: BagelSamplingParams, seeds, policy_version: int):
        """`families.bagel.vllm_omni_pipeline.encode_request`, the prompt framed for the thinker with two stages."""
        return bagel_pipeline.encode_request(prompt, sampling, seeds, policy_version, framed=self.stages > 1)

    def thinker_params(self, sampling: BagelSamplingParams) -> list:
        """The thinker's sampling parameters (vLLM's SamplingParams keywords) before the DiT's, two stages only: one
        greedy token, the prompt's KV sent when its prefill ends (`bagel.yaml`'s transfer criterion). ValueError for
        think mode, which two stages do not run yet (`spec.think_problems`, the validation stage's rule)."""
        if self.stages == 1:
            return []
        refuse(spec.think_problems(self.deploy, sampling.think))
        return [{"max_tokens": 1, "temperature": 0.0}]

    def fingerprint(self) -> str:
        """ema.safetensors without the trainer-ignored prefixes: the bagel_torch engine's and the trainer's."""
        return stored_fingerprint(*spec.fingerprint_files(self.folder))

    def adapter(self, tensors: dict) -> dict:
        """BAGEL's checkpoint module names (vLLM-Omni binds them relative to its `bagel` component); adapters off
        the generation expert refused (`bagel_keymap.generation_expert_adapter`)."""
        return to_vllm_omni(generation_expert_adapter(tensors))
