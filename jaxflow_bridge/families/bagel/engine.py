"""The embedded BAGEL rollout engine (docs/bagel.md §7 (d)): `BagelTorch` + `BagelSamplingLoop` on the CPU, float32.

Config keys: `engine` ("bagel_torch"), `model` (a BAGEL folder: llm_config.json, config.json, ema.safetensors and
the tokenizer; or "tiny_bagel" for the cached tiny random one), `device` ("cpu", the only one for now), `dtype`
("float32", the only one for now), `decode` ("vae", default: the folder's `ae.safetensors` through
`families.bagel.vae.BagelDecoder`, as vLLM-Omni decodes; or "preview": `latent_preview`, no decoder, for plumbing runs),
`random_seed` (optional: the weights drawn by the shared random spec, `jaxflow_bridge/contract/random_weights.py`, by
checkpoint name, as the trainer's `model.init=random`; the folder then needs no ema.safetensors), `lora_apply`
("layers", default; "merged"; "folder": the sinks of `jaxflow_bridge/sync/sinks.py`). A prompt's context
is `<|im_start|>` + its tokens + `<|im_end|>` (docs/bagel.md §4), carried as the trajectory's `prompt_ids`; with the
sampling's `think`, followed by the prompt's think tokens (`families/bagel/think.py`: the checkpoint's text head, loaded
on the first think request, decodes once a prompt). LoRA: PEFT adapters in BAGEL's names (the trainer's
`jaxflow.families.bagel.lora.peft_state_dict`; the `base_model.model.` prefix optional) on the generation expert's
Linears, applied atomically by the engine's sink; each update's reply says what the sink then serves ("served").
Never imports JAX.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import Qwen2TokenizerFast

from jaxflow_bridge.families.bagel.keymap import generation_expert_adapter
from jaxflow_bridge.contract.lora import read_peft
from jaxflow_bridge.contract.lora_payload import LoRAPayload
from jaxflow_bridge.families.bagel.model import BagelTorch
from jaxflow_bridge.families.bagel.sampling import (PIXELS_PER_TOKEN, BagelSamplingLoop, BagelSamplingParams,
                                                    latent_preview)
from jaxflow_bridge.families.bagel.think import TextHead, Thinker
from jaxflow_bridge.families.bagel.vae import BagelDecoder
from jaxflow_bridge.rollout.engine import RolloutEngine, policy_version
from jaxflow_bridge.sync.sinks import SINKS, make_sink
from jaxflow_bridge.rollout.fingerprint import weights_fingerprint
from jaxflow_bridge.rollout.random_weights import torch_weight
from jaxflow_bridge.families.bagel.tiny import bagel_torch_fields


def context_ids(tokenizer, prompt: str) -> list[int]:
    """The conditional context of a prompt: `<|im_start|>`, its tokens, `<|im_end|>` (no think tokens)."""
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    return [start, *tokenizer(prompt, add_special_tokens=False).input_ids, end]


class BagelTorchEngine(RolloutEngine):
    """The `RolloutEngine` interface over one `BagelTorch` and its sampling loop."""

    name = "bagel_torch"
    config_keys = ("engine", "model", "device", "dtype", "decode", "random_seed", "lora_apply")

    def __init__(self, config: dict):
        self.check_config(config)
        for key, only in (("device", "cpu"), ("dtype", "float32")):
            if config.get(key, only) != only:
                raise ValueError(f"{self.name} engine: {key} {config[key]!r} is not supported yet; pass {only!r}")
        if config.get("lora_apply", "layers") not in SINKS:
            raise ValueError(f"{self.name} engine: lora_apply {config['lora_apply']!r}; choose one of {sorted(SINKS)}")
        model = config["model"]
        if model == "tiny_bagel":
            from jaxflow_bridge.families.bagel.tiny import tiny_bagel_path

            model = tiny_bagel_path()
        folder, decode, seed = Path(model), config.get("decode", "vae"), config.get("random_seed")
        if decode not in ("vae", "preview"):
            raise ValueError(f"{self.name} engine: decode {decode!r}; choose 'vae' or 'preview'")
        needed = ["ema.safetensors"] * (seed is None) + ["ae.safetensors"] * (decode == "vae")
        for name in needed:
            if not (folder / name).is_file():
                raise ValueError(f"{self.name} engine: {folder} has no {name}: pass a BAGEL folder (or "
                                 f"model='tiny_bagel')")
        self.model_path = str(folder)
        fields = bagel_torch_fields(folder)
        self.model, self.fields, self.seed, self._head = BagelTorch(**fields), fields, seed, None
        if seed is None:
            self.model.load_checkpoint(load_file(folder / "ema.safetensors"))
        else:  # the shared random spec by checkpoint name, as the trainer draws it (model.init=random)
            self.model.load_checkpoint(self.drawn(self.model.state_dict()))
        self.model.eval()
        self.fingerprint = weights_fingerprint(self.model.state_dict().items())
        self.tokenizer = Qwen2TokenizerFast.from_pretrained(folder)  # BAGEL ships Qwen2.5's tokenizer files
        self.lora = make_sink(config.get("lora_apply", "layers"), self.model, generation_expert_adapter)
        self.lora_config = None
        self.decoder = None
        if decode == "vae":
            self.decoder = BagelDecoder(load_file(folder / "ae.safetensors"), patch=fields["latent_patch_size"])
            if self.decoder.params["z_channels"] != fields["z_channels"]:
                raise ValueError(f"{self.name} engine: config.json's vae_config has z_channels "
                                 f"{fields['z_channels']}, the autoencoder {self.decoder.params['z_channels']}")
        self.think_ids = self.tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
        self.loop = BagelSamplingLoop(self.model, self.decoder or latent_preview, thinker=self.think)
        self.asleep = False

    def drawn(self, like: dict) -> dict:
        """`like`'s tensors drawn by the shared random spec from `random_seed`, by checkpoint name."""
        return {name: torch_weight(int(self.seed), name, tuple(t.shape), torch.float32, "cpu")
                for name, t in like.items()}

    @property
    def head(self) -> TextHead:
        """The checkpoint's text head (think mode's logits), read or drawn on first use: runs without think mode never
        load it (2.2 GB in float32 at full size)."""
        if self._head is None:
            f = self.fields
            head = TextHead(f["hidden_size"], f["vocab_size"], f["rms_norm_eps"])
            if self.seed is None:
                with safe_open(Path(self.model_path) / "ema.safetensors", framework="pt") as file:
                    head.load_checkpoint({k: file.get_tensor(k) for k in head.state_dict() if k in file.keys()})
            else:
                head.load_checkpoint(self.drawn(head.state_dict()))
            self._head = head
        return self._head

    def think(self, ids, max_tokens: int):
        """Think mode's decode of one prompt's context ids (`families.bagel.think.Thinker`)."""
        return Thinker(self.model, self.head, *self.think_ids)(ids, max_tokens)

    def generate(self, prompts: list[str], n: int, sampling: dict, seeds=None) -> dict:
        """TrajectoryBatch.to_dict() of B = len(prompts) * n samples (see BagelSamplingLoop.generate)."""
        params = BagelSamplingParams.from_dict(sampling)
        self.check_awake()
        self.lora.check_serving()
        ids = [context_ids(self.tokenizer, p) for p in prompts]
        return self.loop.generate(ids, n, params, seeds, prompts=list(prompts)).to_dict()

    def update_lora(self, tensors, version: int, adapter_config: dict | None = None) -> dict:
        """{"version", "bound_modules", "served"}; atomic: a refused adapter leaves the previous one serving."""
        self.check_awake()
        version = policy_version(version)
        if isinstance(tensors, (str, Path)):
            tensors, file_config = read_peft(tensors)
            adapter_config = adapter_config or file_config
        adapter_config = adapter_config or self.lora_config
        if not adapter_config:
            raise ValueError("adapter_config (r, lora_alpha) is required for the first LoRA update")
        payload = LoRAPayload(version, dict(adapter_config), tensors)
        bound = self.lora.apply(payload)
        self.loop.policy_version, self.lora_config = version, dict(adapter_config)
        return {"version": version, "bound_modules": bound, "served": self.lora.served(payload).to_dict()}

    def release_adapter(self) -> None:
        """lora_apply="merged": start restoring the bare base weights (sampling waits for the next update)."""
        self.lora.release()

    def sleep(self) -> int:
        """A no-op on the CPU: 0 bytes freed."""
        self.asleep = True
        return 0

    def wake(self) -> None:
        self.asleep = False

    def info(self) -> dict:
        return {"engine": self.name, "device": "cpu", "dtype": "float32", "policy_version": self.loop.policy_version,
                "model": self.model_path, "fingerprint": self.fingerprint, "size_multiple": PIXELS_PER_TOKEN,
                "lora_modules": self.lora.bound_modules(), "asleep": self.asleep, "lora_apply": self.lora.mode}
