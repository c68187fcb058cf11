"""BAGEL (`model.family='bagel'`): a BAGEL folder (llm_config.json, config.json, ema.safetensors, the tokenizer; or
"tiny_bagel"), engines `bagel_torch` (CPU, float32) and vllm_omni (CUDA, bfloat16), text as token ids, LoRA on the
generation expert, BAGEL's text CFG (docs/bagel.md)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from flax import nnx

from jaxflow.algorithms.objective import Objective
from jaxflow.families.bagel import lora as bagel_lora
from jaxflow.families.bagel.loading import folder_config, load_bagel, random_bagel
from jaxflow.families.bagel.config import BagelConfig
from jaxflow.families.bagel.model import BagelModel
from jaxflow.families.bagel.objective import OBJECTIVE
from jaxflow.families.base import Problem, read_json
from jaxflow.nn.weights import TensorSource, entries_fingerprint
from jaxflow.nn.lora import LoRASpec
from jaxflow_bridge.families.bagel import keymap as bagel_keymap
from jaxflow_bridge.families.bagel import spec


class Bagel:
    name = spec.NAME
    engines = spec.ENGINES
    engine_runs = {"bagel_torch": ("float32", "cpu")}  # (rollout dtype, device); vllm_omni's: its rules
    # rollout.lora_apply='auto' on each engine, the one mode each runs: vllm_omni serves BAGEL's adapter through
    # vLLM-Omni's own LoRA apply only
    auto_lora_apply = {"bagel_torch": "layers", "vllm_omni": "folder"}
    tiny = spec.TINY
    tiny_config = "configs/tiny_bagel_ocr.py (the tiny offline BAGEL)"
    example = "/path/to/BAGEL-7B-MoT"
    files = ("llm_config.json", "config.json", "tokenizer.json")
    weights = ("ema.safetensors",)  # read with model.init='checkpoint' only
    one_device = True  # jaxflow.config.validation.check_layout
    stages = spec.DEPLOYS
    thinks = True
    fused_gemm = False  # its layers run XLA's linears (model.lora_gemm 'auto' or 'xla')
    upgrades = False  # its model has no unrolled program to swap to (model.unroll_upgrade)
    config_type = BagelConfig
    model_type = BagelModel

    def folder(self, cfg) -> Path:
        if cfg.model.path == self.tiny:
            from jaxflow_bridge.families.bagel.tiny import tiny_bagel_path
            return tiny_bagel_path()
        return Path(cfg.model.path)

    def _top(self, cfg) -> dict:
        if cfg.model.path == self.tiny:
            from jaxflow_bridge.families.bagel.tiny import top_config
            return top_config()
        return json.loads((Path(cfg.model.path) / "config.json").read_text())

    def check_folder(self, folder: Path) -> None:
        """ValueError naming the folder's file when llm_config.json, config.json or tokenizer.json does not read
        as BAGEL's."""
        for name in self.files:
            read_json(folder / name)
        try:
            folder_config(folder)
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"{folder}'s {', '.join(self.files)} do not describe a BAGEL: {exc!r}") from None

    def problems(self, cfg) -> Iterator[Problem]:
        """The bagel_torch engine's dtype and device, and what BAGEL's trainer and engines do not run yet (the
        vllm_omni engine's rules, `spec.vllm_omni_problems`, are checked with that engine's:
        `validation.engine_problems`)."""
        r = cfg.rollout
        dtype, device = self.engine_runs.get(r.engine, (r.dtype, r.device))
        on = f"on the {r.engine} engine"
        for key, value, ok, want in (
                ("rollout.dtype", r.dtype, r.dtype == dtype, f"'{dtype}' {on}"),
                ("rollout.device", r.device, r.device == device, f"'{device}' {on}"),
                ("rollout.lora_apply", r.lora_apply, r.lora_apply in ("auto", self.auto_lora_apply.get(r.engine)),
                 f"'auto' or {self.auto_lora_apply.get(r.engine)!r} {on} (its one LoRA mode there)"),
                ("model.lora_gemm", cfg.model.lora_gemm, cfg.model.lora_gemm in ("auto", "xla"), "'auto' or 'xla'"),
                ("train.algorithm", cfg.train.algorithm, cfg.train.algorithm == "flowgrpo", "'flowgrpo'"),
                ("sample.negative_prompt", cfg.sample.negative_prompt, cfg.sample.negative_prompt == "",
                 "'' (its text CFG's unconditional branch is the empty context)")):
            if not ok:
                yield key, f"{value!r}: BAGEL runs with {want} for now (docs/bagel.md §7)"

    def size_multiple(self, cfg) -> int:
        return spec.pixels_per_token(self._top(cfg))

    def grid_hw(self, folder: Path, cfg) -> tuple[int, int]:
        """Latent tokens per side; each side at most config.json's max_latent_size (the position table's)."""
        top = json.loads((folder / "config.json").read_text())
        m = spec.pixels_per_token(top)
        grid = cfg.sample.height // m, cfg.sample.width // m
        if max(grid) > top["max_latent_size"]:
            raise ValueError(f"config.sample.height/width: {cfg.sample.height}x{cfg.sample.width} is {grid} latent "
                             f"tokens; this BAGEL holds at most {top['max_latent_size']} a side "
                             f"({top['max_latent_size'] * m} pixels)")
        return grid

    lora_spec_type = bagel_lora.BagelLoRASpec


    def image_tokens(self, folder: Path, cfg) -> int:
        """A sample's image tokens in the sequence: the generated image's latent grid (a text-to-image prompt)."""
        h, w = self.grid_hw(folder, cfg)
        return h * w
    def weights_source(self, folder: Path) -> tuple[TensorSource, int]:
        """ema.safetensors' tensors and the LLM's layer count (llm_config.json)."""
        layers = json.loads((folder / "llm_config.json").read_text())["num_hidden_layers"]
        return TensorSource.from_file(folder / "ema.safetensors"), layers

    def random_weights(self, folder: Path) -> list[tuple[str, tuple[int, ...], int]]:
        """None drawn on the devices: a random BAGEL folder is written with its weights."""
        return []

    def lora_spec(self, cfg) -> LoRASpec:
        return bagel_lora.BagelLoRASpec(rank=cfg.lora.rank, alpha=cfg.lora.alpha, targets=tuple(cfg.lora.targets))

    def num_layers(self, folder: Path) -> int:
        return folder_config(folder).num_hidden_layers

    def build_model(self, cfg, folder: Path, spec, opts, **kw):
        """BAGEL's generation path from the folder's ema.safetensors (checkpoint names through bagel_keymap), or
        drawn from `seed` with model.init=random, with ModelOptions `opts` (the plan's); its markers' ids from
        tokenizer.json, fresh adapters from `seed`. One device (jaxflow.config.validation.check_layout): its weights
        carry no sharding yet."""
        mc = folder_config(folder)
        if cfg.model.init == "random":
            return random_bagel(mc, opts, spec, kw["seed"])
        return load_bagel(folder, opts, spec, kw["seed"])

    def abstract_unrolled(self, model, opts):
        raise ValueError(f"{self.name}'s model has no unrolled program to swap to: leave model.unroll_upgrade='off'")

    def unroll(self, model, opts) -> None:
        raise ValueError(f"{self.name}'s model has no unrolled program to swap to: leave model.unroll_upgrade='off'")

    def owns(self, model) -> bool:
        return isinstance(model, BagelModel)

    def objective(self, config) -> Objective:
        """BAGEL's log-prob (`objective.OBJECTIVE`: contexts prefilled once from the token ids, its text CFG); it
        refuses what it cannot train yet: DiffusionNFT. (Its KL reference is the model with its adapters off,
        lora_scale 0; the contexts need none: the adapters are on the generation expert only.)"""
        if not config.policy.loss.log_probs:
            raise ValueError(f"train.algorithm={config.algorithm!r}: BAGEL trains with 'flowgrpo' only")
        return OBJECTIVE

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
                 solver=s.solver, noise_level=s.noise_level, sde_window_size=s.window_size,
                 sde_window_range=tuple(s.window_range),
                 same_latent=s.same_latent, keep_final=False, think=s.think, max_think_tokens=s.max_think_tokens)
        if eval_mode:
            d.update(num_inference_steps=cfg.eval.num_steps, cfg_text_scale=cfg.eval.guidance, sde_type="ode",
                     solver=cfg.eval.solver, noise_level=0.0, sde_window_size=None, same_latent=False)
        return d

    def vision_tokens(self, cfg) -> int:
        return 0  # a text-only prompt (its think tokens: sample.max_think_tokens)
