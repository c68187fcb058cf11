"""The embedded rollout engine: a family's `RolloutPipeline` on diffusers components, on CPU or one GPU.

Config keys: `engine` ("diffusers"), `model` (a local diffusers folder of a family this engine serves: its
`spec.ENGINES` names "diffusers" and its torch folder holds `diffusers_pipeline.py`; or that family's tiny model's
name, e.g. "tiny", for the cached tiny random pipeline), `dtype` ("bfloat16" default, or "float32"), `device`
(default: cuda if available),
`random_seed` (optional: ignore the folder's transformer weights and draw them from this seed on the device,
`jaxflow_bridge/contract/random_weights.py`; the trainer with `model.init=random` draws the same), `compile` (optional: compile the
transformer's repeated block once with torch.compile, dynamic shapes; inductor fuses the eager elementwise kernels),
`cfg_forward` ("batched" or "split": true CFG's rows in one forward or two, `jaxflow_bridge.rollout.sampling`),
`base_weights` ("own", default, or "shared": the transformer's weights come from `share_base_weights`, torch
tensors of the trainer's in the same process, not copied; `jaxflow_bridge/rollout/shared_weights.py`), `lora_apply`
("layers", default; "merged" into the base weights; "folder": loaded from a PEFT folder; `jaxflow_bridge/sync/sinks.py`).
Everything crossing the engine boundary is numpy or plain Python, but the shared weights (in process only).
"""

from __future__ import annotations

from pathlib import Path

import torch

from jaxflow_bridge.engines import families
from jaxflow_bridge.rollout.engine import RolloutEngine
from jaxflow_bridge.contract.schedule import cfg_forward_choice
from jaxflow_bridge.rollout.sampling import SamplingLoop, SamplingParams


def family_pipelines(model: str):
    """(its family's diffusers_pipeline module, its folder) for `model`, a folder or a family's tiny model name
    (the cached tiny folder); ValueError in one line for a folder of no family this engine serves."""
    specs = [families.spec(name) for name in families.FAMILIES]
    specs = [s for s in specs if "diffusers" in s.ENGINES]
    for spec in specs:
        if model == spec.TINY or spec.is_folder(Path(model)):
            pipelines = families.module(spec.NAME, "diffusers_pipeline")
            return pipelines, pipelines.tiny_folder() if model == spec.TINY else model
    raise ValueError(f"diffusers engine: {model} is not {' nor '.join(s.FOLDER for s in specs)}")


class DiffusersEngine(RolloutEngine):
    """The `RolloutEngine` interface over one `RolloutPipeline`."""

    name = "diffusers"
    config_keys = ("engine", "model", "dtype", "device", "random_seed", "compile", "cfg_forward", "base_weights",
                   "lora_apply")

    def __init__(self, config: dict):
        self.check_config(config)
        cfg_forward = cfg_forward_choice(config.get("cfg_forward", SamplingLoop.cfg_forward))
        pipelines, model = family_pipelines(config["model"])
        base = config.get("base_weights", "own")
        if base not in ("own", "shared") or (base == "shared" and config.get("random_seed") is not None):
            raise ValueError(f"base_weights: {base!r}; choose 'own' or 'shared' (without random_seed: the shared "
                             "weights are the trainer's)")
        self.pipeline = pipelines.RolloutPipeline.from_pretrained(
            model, config.get("dtype", "bfloat16"), config.get("device"), random_seed=config.get("random_seed"),
            shared_base=base == "shared", lora_apply=config.get("lora_apply", "layers"))
        self.shared_base = base == "shared"
        self.pipeline.cfg_forward = cfg_forward
        self.device = self.pipeline.device
        if config.get("compile"):  # lazy: the first generate compiles (with the LoRA layers bound by then)
            self.pipeline.transformer.compile_repeated_blocks(dynamic=True)
        self.asleep = False

    def check_awake(self) -> None:
        super().check_awake()
        if self.pipeline.fingerprint is None:
            raise RuntimeError("the rollout engine waits for its base weights: call share_base_weights first")

    def share_base_weights(self, tensors: dict) -> dict:
        """Serve the trainer's base weights (diffusers name -> torch tensor on the engine's device, in its dtype)
        without a copy; returns info()."""
        if not self.shared_base:
            raise RuntimeError("this engine keeps its own base weights: start it with base_weights='shared'")
        self.pipeline.share_base_weights(tensors)
        return self.info()

    def generate(self, prompts: list[str], n: int, sampling: dict, seeds=None, references=None) -> dict:
        """TrajectoryBatch.to_dict() of B = len(prompts) * n samples (see RolloutPipeline.generate); references:
        an edit model's, per prompt."""
        params = SamplingParams.from_dict(sampling)
        self.check_awake()
        self.pipeline.lora.check_serving()
        return self.pipeline.generate(prompts, n, params, seeds, references=references).to_dict()

    def update_lora(self, tensors, version: int, adapter_config: dict | None = None) -> dict:
        """{"version", "bound_modules"}; atomic: a refused adapter leaves the previous one serving."""
        self.check_awake()
        return self.pipeline.update_lora(tensors, version, adapter_config)

    def release_adapter(self) -> None:
        """lora_apply="merged": start restoring the bare base weights (sampling waits for the next update)."""
        self.pipeline.lora.release()

    def sleep(self) -> int:
        """Move the text encoder, VAE and transformer (LoRA included) to CPU; returns the GPU bytes freed (a no-op
        returning 0 on CPU)."""
        if self.shared_base:
            raise RuntimeError("an engine on the trainer's shared base weights cannot sleep: they are the trainer's")
        if self.device.type == "cpu" or self.asleep:
            return 0
        self.pipeline.lora.settle()
        before = torch.cuda.memory_reserved(self.device)
        self.pipeline.to("cpu")
        torch.cuda.empty_cache()
        self.asleep = True
        return before - torch.cuda.memory_reserved(self.device)

    def wake(self) -> None:
        """Move the models back to their device (a no-op on CPU)."""
        if self.device.type != "cpu":
            self.pipeline.to(self.device)
        self.asleep = False

    def info(self) -> dict:
        p = self.pipeline
        return {"engine": self.name, "device": str(self.device), "dtype": str(p.dtype).removeprefix("torch."),
                "policy_version": p.policy_version, "model": p.model_path, "fingerprint": p.fingerprint,
                "size_multiple": p.size_multiple, "lora_modules": p.lora.bound_modules(), "asleep": self.asleep,
                "base_weights": "shared" if self.shared_base else "own", "lora_apply": p.lora.mode}
