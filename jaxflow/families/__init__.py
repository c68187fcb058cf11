"""Model families the training program runs, chosen by `model.family` (docs/bagel.md §7 (e)): what it reads from a
model folder (files, image geometry, the base weights), the LoRA spec, the engines that serve the family, the
rollout's sampling keys, the train batch's text kind, the exported adapter and the base-weight fingerprint. The
train step itself is the same for every family (`jaxflow.objectives` picks the log-prob from the model).

- `qwen_image`: a diffusers Qwen-Image folder (or "tiny"), engines diffusers and vllm_omni, text as embeds.
- `bagel`: a BAGEL folder (llm_config.json, config.json, ema.safetensors, the tokenizer; or "tiny_bagel"), engines
  `bagel_torch` (CPU, float32) and vllm_omni (CUDA, bfloat16), text as token ids, LoRA on the generation expert,
  BAGEL's text CFG.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from flax import nnx

from jaxflow.models import lora as qwen_lora
from jaxflow.families.bagel import lora as bagel_lora
from jaxflow.families.bagel.loading import folder_config, load_bagel, random_bagel
from jaxflow.models.config import QwenImageConfig
from jaxflow.models.loading import entries_fingerprint, fingerprint, load_transformer
from jaxflow.models.lora import LoRASpec
from jaxflow.models.random_init import random_transformer
from jaxflow_bridge.contract import bagel_keymap
from jaxflow_bridge.contract.schedule import pixels_per_token

log = logging.getLogger("jaxflow.train")


def read_json(path: Path) -> dict:
    """A folder's JSON config as a dict; ValueError naming the file when it is not valid JSON or not an object."""
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON ({'empty file' if not path.read_bytes().strip() else exc})") \
            from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a {type(data).__name__}, not a JSON object")
    return data


class QwenImage:
    name = "qwen_image"
    engines = ("diffusers", "vllm_omni")
    merges_lora = True  # vllm_omni's rollout.lora_mode='auto' merges the adapter into the base weights
    tiny = "tiny"
    tiny_config = "configs/tiny_ocr.py (the embedded tiny offline model)"
    example = "/path/to/Qwen-Image (a diffusers folder)"
    files = ("model_index.json", "transformer/config.json")
    weights = ()  # one file or a sharded index: transformer/ is checked as it loads

    def folder(self, cfg) -> Path:
        if cfg.model.path == self.tiny:
            from jaxflow_bridge.random_models.tiny import tiny_pipeline_path
            return tiny_pipeline_path(dtype=cfg.rollout.dtype)
        return Path(cfg.model.path)

    def check_folder(self, folder: Path) -> None:
        """ValueError naming the file when transformer/config.json does not read as a Qwen-Image transformer (or
        vae/config.json not as JSON)."""
        if (folder / "vae" / "config.json").exists():
            read_json(folder / "vae" / "config.json")
        path = folder / "transformer" / "config.json"
        try:
            QwenImageConfig.from_dict(read_json(path))
        except (TypeError, ValueError) as exc:
            message = str(exc)
            raise ValueError(message if message.startswith(str(path)) else f"{path}: {message}") from None

    def size_multiple(self, cfg) -> int:
        """`pixels_per_token` of the VAE: the folder's vae/config.json or the tiny model's."""
        if cfg.model.path == self.tiny:
            from jaxflow_bridge.random_models.tiny import TINY_VAE_CONFIG
            vae = TINY_VAE_CONFIG
        else:
            path = Path(cfg.model.path) / "vae" / "config.json"
            if not path.exists():
                raise FileNotFoundError(f"{cfg.model.path} has no vae/config.json: it must be a diffusers Qwen-Image "
                                        "folder")
            vae = json.loads(path.read_text())
        return pixels_per_token(vae)

    def grid_hw(self, folder: Path, cfg) -> tuple[int, int]:
        """Packed latent grid: a token spans `pixels_per_token` of the folder's VAE per side."""
        factor = pixels_per_token(json.loads((folder / "vae" / "config.json").read_text()))
        return cfg.sample.height // factor, cfg.sample.width // factor

    def lora_spec(self, cfg) -> LoRASpec:
        return LoRASpec(rank=cfg.lora.rank, alpha=cfg.lora.alpha, targets=tuple(cfg.lora.targets))

    def build_model(self, cfg, folder: Path, spec, opts_for, **kw):
        """The transformer of `folder`: loaded, or drawn from `seed` with model.init=random; `opts_for(num_layers)`
        resolves the ModelOptions (model.lora_gemm) for its depth."""
        mc = QwenImageConfig.from_json(folder / "transformer" / "config.json")
        opts = opts_for(mc.num_layers)
        if cfg.model.init == "random":
            model = random_transformer(mc, opts, spec, **kw)
        else:
            model = load_transformer(folder / "transformer", opts, spec, **kw)
        if model.unrolled:
            model.unstack_blocks()
        return model

    def batch_shape(self, model) -> dict:
        """memory.abstract_batch's model-dependent arguments."""
        return dict(channels=model.cfg.in_channels, width=model.cfg.joint_attention_dim, text_ids=False)

    def save_peft(self, lora, spec, directory: Path) -> None:
        qwen_lora.save_peft(lora, spec, directory)

    def fingerprint(self, model) -> str:
        return fingerprint(model)

    def engine_config(self, cfg) -> dict:
        return {"cfg_forward": cfg.rollout.cfg_forward}

    def sampling(self, cfg, eval_mode: bool) -> dict:
        s = cfg.sample
        d = dict(height=s.height, width=s.width, num_inference_steps=s.num_steps, true_cfg_scale=s.guidance,
                 negative_prompt=s.negative_prompt, max_sequence_length=s.max_sequence_length, sde_type=s.sde_type,
                 noise_level=s.noise_level, sde_window_size=s.window_size, sde_window_range=tuple(s.window_range),
                 same_latent=s.same_latent, keep_final=cfg.train.algorithm == "nft")
        if eval_mode:
            d.update(num_inference_steps=cfg.eval.num_steps, true_cfg_scale=cfg.eval.guidance, sde_type="ode",
                     noise_level=0.0, sde_window_size=None, same_latent=False, keep_final=False)
        return d


class Bagel:
    name = "bagel"
    engine_runs = {"bagel_torch": ("float32", "cpu"), "vllm_omni": ("bfloat16", "cuda")}  # (rollout dtype, device)
    engines = tuple(engine_runs)
    merges_lora = False  # vllm_omni serves BAGEL's adapter through vLLM-Omni's LoRA layers only
    tiny = "tiny_bagel"
    tiny_config = "configs/tiny_bagel_ocr.py (the tiny offline BAGEL)"
    example = "/path/to/BAGEL-7B-MoT"
    files = ("llm_config.json", "config.json", "tokenizer.json")
    weights = ("ema.safetensors",)  # read with model.init='checkpoint' only

    def folder(self, cfg) -> Path:
        if cfg.model.path == self.tiny:
            from jaxflow_bridge.random_models.tiny_bagel import tiny_bagel_path
            return tiny_bagel_path()
        return Path(cfg.model.path)

    def _top(self, cfg) -> dict:
        if cfg.model.path == self.tiny:
            from jaxflow_bridge.random_models.tiny_bagel import top_config
            return top_config()
        return json.loads((Path(cfg.model.path) / "config.json").read_text())

    @staticmethod
    def _per_token(top: dict) -> int:
        """Pixels per latent token (a side): the VAE's downsampling x latent_patch_size (16 for BAGEL)."""
        return top["vae_config"]["downsample"] * top["latent_patch_size"]

    def check_folder(self, folder: Path) -> None:
        """ValueError naming the folder's file when llm_config.json, config.json or tokenizer.json does not read
        as BAGEL's."""
        for name in self.files:
            read_json(folder / name)
        try:
            folder_config(folder)
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"{folder}'s {', '.join(self.files)} do not describe a BAGEL: {exc!r}") from None

    def size_multiple(self, cfg) -> int:
        return self._per_token(self._top(cfg))

    def grid_hw(self, folder: Path, cfg) -> tuple[int, int]:
        """Latent tokens per side; each side at most config.json's max_latent_size (the position table's)."""
        top = json.loads((folder / "config.json").read_text())
        m = self._per_token(top)
        grid = cfg.sample.height // m, cfg.sample.width // m
        if max(grid) > top["max_latent_size"]:
            raise ValueError(f"config.sample.height/width: {cfg.sample.height}x{cfg.sample.width} is {grid} latent "
                             f"tokens; this BAGEL holds at most {top['max_latent_size']} a side "
                             f"({top['max_latent_size'] * m} pixels)")
        return grid

    def lora_spec(self, cfg) -> LoRASpec:
        return bagel_lora.BagelLoRASpec(rank=cfg.lora.rank, alpha=cfg.lora.alpha, targets=tuple(cfg.lora.targets))

    def build_model(self, cfg, folder: Path, spec, opts_for, **kw):
        """BAGEL's generation path from the folder's ema.safetensors (checkpoint names through bagel_keymap), or
        drawn from `seed` with model.init=random; its markers' ids from tokenizer.json, fresh adapters from `seed`.
        One device (jaxflow.config.check_layout): its weights carry no sharding yet."""
        mc = folder_config(folder)
        opts = opts_for(mc.num_hidden_layers)
        if opts.lora_gemm != "xla":  # "auto" resolved to the fused kernel, which BAGEL's layers do not call
            log.info("BAGEL's linears run model.lora_gemm=xla (its layers have no fused-kernel path)")
            opts = dataclasses.replace(opts, lora_gemm="xla")
        if cfg.model.init == "random":
            return random_bagel(mc, opts, spec, kw["seed"])
        return load_bagel(folder, opts, spec, kw["seed"])

    def batch_shape(self, model) -> dict:
        return dict(channels=model.cfg.latent_dim, width=1, text_ids=True)

    def save_peft(self, lora, spec, directory: Path) -> None:
        bagel_lora.save_peft(lora, spec, directory)

    def fingerprint(self, model) -> str:
        """The rollout's `weights_fingerprint` of the same weights (over BAGEL's checkpoint names)."""
        return entries_fingerprint(nnx.state(model, nnx.Param), bagel_keymap.key_map(), model.cfg.num_hidden_layers)

    def engine_config(self, cfg) -> dict:
        """vllm_omni: the deployment (rollout.bagel_deploy) and the thinker's share of the GPU where given
        (rollout.thinker_memory: vLLM-Omni's per-stage `stage_0_gpu_memory_utilization`)."""
        if cfg.rollout.engine != "vllm_omni":
            return {}
        engine = {"deploy": cfg.rollout.bagel_deploy}
        if cfg.rollout.thinker_memory:
            engine["omni_args"] = {"stage_0_gpu_memory_utilization": cfg.rollout.thinker_memory}
        return engine

    def sampling(self, cfg, eval_mode: bool) -> dict:
        """BagelSamplingParams' keys: BAGEL's text CFG (scale sample.guidance, sample.cfg_interval,
        sample.cfg_renorm_min); its unconditional branch is the empty context (no negative prompt); think mode
        (sample.think, sample.max_think_tokens), the evals' too (the policy's context)."""
        s = cfg.sample
        d = dict(height=s.height, width=s.width, num_inference_steps=s.num_steps, cfg_text_scale=s.guidance,
                 cfg_interval=tuple(s.cfg_interval), cfg_renorm_min=s.cfg_renorm_min, sde_type=s.sde_type,
                 noise_level=s.noise_level, sde_window_size=s.window_size, sde_window_range=tuple(s.window_range),
                 same_latent=s.same_latent, keep_final=False, think=s.think, max_think_tokens=s.max_think_tokens)
        if eval_mode:
            d.update(num_inference_steps=cfg.eval.num_steps, cfg_text_scale=cfg.eval.guidance, sde_type="ode",
                     noise_level=0.0, sde_window_size=None, same_latent=False)
        return d


_FAMILIES = {f.name: f for f in (QwenImage(), Bagel())}
FAMILIES = tuple(_FAMILIES)


def by_name(name: str):
    """The family called `name` (one of FAMILIES)."""
    return _FAMILIES[name]


def of(cfg):
    """The config's family (`model.family`, validated at start)."""
    return by_name(cfg.model.family)
