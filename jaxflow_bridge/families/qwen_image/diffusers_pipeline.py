"""Our Qwen-Image rollout pipeline on diffusers components: `SamplingLoop` (jaxflow_bridge/rollout/sampling.py) over
the components of a diffusers `QwenImagePipeline`, plus its weights fingerprint and LoRA updates.
Never imports JAX.
"""

from __future__ import annotations

from pathlib import Path

import torch

from jaxflow_bridge.contract.lora import read_peft
from jaxflow_bridge.contract.lora_payload import LoRAPayload
from jaxflow_bridge.families.qwen_image.random_init import random_transformer
from jaxflow_bridge.rollout.engine import policy_version
from jaxflow_bridge.rollout.fingerprint import weights_fingerprint
from jaxflow_bridge.rollout.sampling import Fp32Timestep, SamplingLoop
from jaxflow_bridge.rollout.shared_weights import (
    empty_transformer,
    share_parameters,
    waiting_for_weights,
)
from jaxflow_bridge.sync.sinks import make_sink

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def tiny_folder() -> Path:
    """The cached tiny Qwen-Image folder (float32) the diffusers engine serves for model "tiny"."""
    from jaxflow_bridge.families.qwen_image.tiny import tiny_pipeline_path

    return tiny_pipeline_path()


def text_tower(encoder):
    """The part of Qwen2.5-VL that encodes text prompts: its base model (`hidden_states[-1]` as the whole model's),
    without the vision tower (detached from `encoder`: no image reaches it) and without the output head (prompt
    embeddings are hidden states): 2.3 GB less of the 7B encoder to hold on the device."""
    inner = encoder.model
    if getattr(inner, "visual", None) is not None:
        inner.visual = None
    return inner


class RolloutPipeline(SamplingLoop):
    """Qwen-Image sampling with trajectories, on the components of a diffusers `QwenImagePipeline` (it takes them:
    the text encoder keeps only its text tower, `text_tower`)."""

    def __init__(self, pipe, device: str | torch.device = "cpu", model_path: str | None = None,
                 lora_apply: str = "layers"):
        self.tokenizer, self.text_encoder, self.vae = pipe.tokenizer, self.text_model(pipe.text_encoder), pipe.vae
        self.transformer = pipe.transformer
        self.scheduler_config = dict(pipe.scheduler.config)
        self.template, self.drop = pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx
        self.vae_scale_factor = pipe.vae_scale_factor
        self.device, self.model_path = torch.device(device), model_path
        for module in self.modules:
            if not waiting_for_weights(module):  # a transformer built for shared weights waits for them
                module.to(self.device)
            module.eval().requires_grad_(False)
        self.fingerprint = (None if waiting_for_weights(self.transformer) else
                            weights_fingerprint(self.transformer.state_dict().items()))
        self.fp32_timestep = Fp32Timestep(self.transformer)
        self.lora = make_sink(lora_apply, self.transformer)  # jaxflow_bridge/sync/sinks.py
        self.lora_config, self.policy_version = None, 0

    text_model = staticmethod(text_tower)  # the part of the pipeline's text encoder it keeps

    @classmethod
    def diffusers_pipeline(cls, path, **kw):
        """The diffusers pipeline of the folder `path` (`from_pretrained(path, **kw)`)."""
        from diffusers import QwenImagePipeline

        return QwenImagePipeline.from_pretrained(path, **kw)

    @classmethod
    def from_pretrained(cls, path, dtype: str = "bfloat16", device: str | None = None,
                        random_seed: int | None = None, shared_base: bool = False,
                        lora_apply: str = "layers") -> RolloutPipeline:
        """Load a diffusers Qwen-Image folder (local only) in `dtype` onto `device` (default: cuda if available).
        With `random_seed`, the transformer's weights are not read: they are drawn on `device` by the shared spec
        (`jaxflow_bridge/contract/random_weights.py`), so the folder needs only `transformer/config.json`. With
        `shared_base`, they are neither read nor drawn: the transformer waits for `share_base_weights`."""
        from diffusers import QwenImageTransformer2DModel

        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        parts = {}
        if random_seed is not None or shared_base:
            config = QwenImageTransformer2DModel.load_config(Path(path) / "transformer")
            parts["transformer"] = (empty_transformer(config, DTYPES[dtype]) if shared_base else
                                    random_transformer(config, int(random_seed), DTYPES[dtype], device))
        pipe = cls.diffusers_pipeline(path, dtype=DTYPES[dtype], local_files_only=True, **parts)
        return cls(pipe, device, str(Path(path)), lora_apply)

    @property
    def modules(self) -> tuple[torch.nn.Module, ...]:
        return self.text_encoder, self.vae, self.transformer

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    def to(self, device) -> None:
        """Move the text encoder, VAE and transformer (LoRA included); generation follows."""
        self.device = torch.device(device)
        for module in self.modules:
            module.to(self.device)

    def share_base_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Serve `tensors` (diffusers name -> tensor on this pipeline's device and dtype, e.g. DLPack views of the
        trainer's weights) as the transformer's base weights, without a copy (`shared_weights.share_parameters`:
        checked first, nothing changes on a mismatch); then the fingerprint of what it now holds."""
        here = torch.empty(0, device=self.device).device  # "cuda" as the index it means
        wrong = sorted({str(t.device) for t in tensors.values() if t.device != here})
        if wrong:
            raise ValueError(f"shared base weights on {wrong}, the pipeline runs on {self.device}")
        share_parameters(self.transformer, tensors)
        self.transformer.to(self.device)  # its buffers; the parameters are there already
        self.fingerprint = weights_fingerprint(self.transformer.state_dict().items())

    # ------------------------------------------------------------------------------------------ LoRA

    def update_lora(self, tensors, version: int, adapter_config: dict | None = None) -> dict:
        """Serve a PEFT LoRA adapter (dict or path; adapter_config defaults to the folder's, then the previous
        one's) as policy `version`; atomic (see jaxflow_bridge/sync/sinks.py)."""
        if isinstance(tensors, (str, Path)):
            tensors, file_config = read_peft(tensors)
            adapter_config = adapter_config or file_config
        return self.serve_lora(LoRAPayload(policy_version(version), adapter_config or self.lora_config, tensors))

    def serve_lora(self, payload: LoRAPayload) -> dict:
        """Serve `payload` through the pipeline's sink; {"version", "bound_modules", "served": what the sink now
        serves at the probe's positions (contract/served.py)}."""
        if not payload.config:
            raise ValueError("adapter_config (r, lora_alpha) is required for the first LoRA update")
        bound = self.lora.apply(payload)
        self.lora_config, self.policy_version = dict(payload.config), policy_version(payload.version)
        return {"version": self.policy_version, "bound_modules": bound,
                "served": self.lora.served(payload).to_dict()}
