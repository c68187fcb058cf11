"""Qwen-Image (`model.family='qwen_image'`): a diffusers Qwen-Image folder (or "tiny"), engines diffusers and
vllm_omni, text as embeds, true CFG; its identity is `jaxflow_bridge/families/qwen_image/spec.py`, its transformer
and loading are beside this module (shared layers: `jaxflow/nn/`)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterator

from jaxflow.algorithms import registry
from jaxflow.algorithms.objective import WINDOW, Objective
from jaxflow.families.base import Problem, read_json
from jaxflow.families.qwen_image.lora import QwenImageLoRASpec
from jaxflow.nn import lora as lora_peft
from jaxflow.families.qwen_image.config import QwenImageConfig
from jaxflow.families.qwen_image.loading import checkpoint_shapes, fingerprint, load_transformer
from jaxflow.nn.lora import LoRASpec
from jaxflow.nn.weights import TensorSource
from jaxflow.families.qwen_image.random_init import random_transformer
from jaxflow.families.qwen_image.transformer import QwenImageTransformer
from jaxflow_bridge.families.qwen_image import spec


class QwenImage:
    name = spec.NAME
    engines = spec.ENGINES
    auto_lora_apply = {"diffusers": "layers", "vllm_omni": "merged"}  # rollout.lora_apply='auto' on each engine
    tiny = spec.TINY
    tiny_config = "configs/tiny_ocr.py (the embedded tiny offline model)"
    example = "/path/to/Qwen-Image (a diffusers folder)"
    files = ("model_index.json", "transformer/config.json")
    weights = ()  # one file or a sharded index: transformer/ is checked as it loads
    one_device = False
    stages = ("single_stage",)
    thinks = False
    fused_gemm = True
    upgrades = True  # its model swaps to unrolled blocks mid-run (`unroll`)
    config_type = QwenImageConfig
    model_type = QwenImageTransformer

    def folder(self, cfg) -> Path:
        if cfg.model.path == self.tiny:
            from jaxflow_bridge.families.qwen_image.tiny import tiny_pipeline_path
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

    def problems(self, cfg) -> Iterator[Problem]:
        """BAGEL's text CFG keys left at their defaults (Qwen-Image's true CFG has neither)."""
        if tuple(cfg.sample.cfg_interval) != (0.0, 1.0) or cfg.sample.cfg_renorm_min != 0.0:
            yield "sample.cfg_interval", ("and sample.cfg_renorm_min are BAGEL's text CFG; Qwen-Image's true CFG has "
                                          "neither: leave them at 0.0, 1.0 and 0.0")

    def size_multiple(self, cfg) -> int:
        """`pixels_per_token` of the VAE: the folder's vae/config.json or the tiny model's."""
        if cfg.model.path == self.tiny:
            from jaxflow_bridge.families.qwen_image.tiny import TINY_VAE_CONFIG
            vae = TINY_VAE_CONFIG
        else:
            path = Path(cfg.model.path) / "vae" / "config.json"
            if not path.exists():
                raise FileNotFoundError(f"{cfg.model.path} has no vae/config.json: it must be a diffusers Qwen-Image "
                                        "folder")
            vae = json.loads(path.read_text())
        return spec.pixels_per_token(vae)

    def grid_hw(self, folder: Path, cfg) -> tuple[int, int]:
        """Packed latent grid: a token spans `pixels_per_token` of the folder's VAE per side."""
        factor = spec.size_multiple(folder)
        return cfg.sample.height // factor, cfg.sample.width // factor

    def image_tokens(self, folder: Path, cfg) -> int:
        """A sample's image tokens in the transformer's sequence: the target's latent grid."""
        h, w = self.grid_hw(folder, cfg)
        return h * w

    lora_spec_type = QwenImageLoRASpec

    def weights_source(self, folder: Path) -> tuple[TensorSource, int]:
        """A diffusers `transformer/` folder's tensors and its block count."""
        return TensorSource.from_folder(folder), QwenImageConfig.from_json(folder / "config.json").num_layers

    def random_weights(self, folder: Path) -> list[tuple[str, tuple[int, ...], int]]:
        """(key, shape, bytes in bf16) of the transformer's tensors from `folder`'s transformer/config.json, for a
        folder without its weights (model.init=random draws them on the devices)."""
        mc = QwenImageConfig.from_json(folder / "transformer" / "config.json")
        return [(key, shape, 2 * math.prod(shape)) for key, shape, _ in checkpoint_shapes(mc, self.model_type)]

    def lora_spec(self, cfg) -> LoRASpec:
        return QwenImageLoRASpec(rank=cfg.lora.rank, alpha=cfg.lora.alpha, targets=tuple(cfg.lora.targets))

    def num_layers(self, folder: Path) -> int:
        return QwenImageConfig.from_json(folder / "transformer" / "config.json").num_layers

    def build_model(self, cfg, folder: Path, spec, opts, **kw):
        """The transformer of `folder` with ModelOptions `opts` (the plan's): loaded, or drawn from `seed` with
        model.init=random."""
        mc = QwenImageConfig.from_json(folder / "transformer" / "config.json")
        if cfg.model.init == "random":
            model = random_transformer(mc, opts, spec, model_type=self.model_type, **kw)
        else:
            model = load_transformer(folder / "transformer", opts, spec, model_type=self.model_type, **kw)
        if model.unrolled:
            model.unstack_blocks()
        return model

    def abstract_unrolled(self, model, opts):
        """The model as it runs `opts`' unrolled blocks, abstract (`QwenImageTransformer.abstract_unrolled`)."""
        return model.abstract_unrolled(opts)

    def unroll(self, model, opts) -> None:
        """Swap the model to `opts`' unrolled blocks (`QwenImageTransformer.unroll`)."""
        model.unroll(opts)

    def owns(self, model) -> bool:
        return type(model) is self.model_type  # not a subclass: the edit family's model is one

    def objective(self, config) -> Objective:
        """The window log-prob on the batch's text embeds (`flowgrpo.window_log_prob`), true CFG."""
        return WINDOW

    def batch_shape(self, model) -> dict:
        """memory.abstract_batch's model-dependent arguments."""
        return dict(channels=model.cfg.in_channels, width=model.cfg.joint_attention_dim, text_ids=False)

    def save_peft(self, lora, spec, directory: Path) -> None:
        lora_peft.save_peft(lora, spec, directory)

    def fingerprint(self, model) -> str:
        return fingerprint(model)

    def engine_config(self, cfg) -> dict:
        return {"cfg_forward": cfg.rollout.cfg_forward}

    def sampling(self, cfg, eval_mode: bool) -> dict:
        s = cfg.sample
        d = dict(height=s.height, width=s.width, num_inference_steps=s.num_steps, true_cfg_scale=s.guidance,
                 negative_prompt=s.negative_prompt, max_sequence_length=s.max_sequence_length, sde_type=s.sde_type,
                 solver=s.solver, noise_level=s.noise_level, sde_window_size=s.window_size,
                 sde_window_range=tuple(s.window_range),
                 same_latent=s.same_latent, keep_final=registry.final_latents(cfg.train.algorithm))
        if eval_mode:
            d.update(num_inference_steps=cfg.eval.num_steps, true_cfg_scale=cfg.eval.guidance, sde_type="ode",
                     solver=cfg.eval.solver, noise_level=0.0, sde_window_size=None, same_latent=False, keep_final=False)
        return d

    def vision_tokens(self, cfg) -> int:
        return 0  # a text-only prompt
