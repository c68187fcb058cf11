"""Training config: validation before anything heavy starts, and the typed objects derived from it."""
from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Iterator

from ml_collections import ConfigDict

from jaxflow import families
from jaxflow.algorithms import registry
from jaxflow.config import sections
from jaxflow.config.derived import (lora_spec, model_options, sampling, sharding_config, train_config,
                                    xla_options)
from jaxflow.config.errors import UserError, fail
from jaxflow.config.plan import UNROLL_UPGRADES, engine_per_device
from jaxflow.config.sections import RunConfig
from jaxflow.families.base import Problem, option_problems
from jaxflow.run.data import load_prompts
from jaxflow.run.wandb_log import MODES as WANDB_MODES
from jaxflow.nn.config import LORA_GEMMS
from jaxflow.trainer.step_config import TrainConfig
from jaxflow_bridge.contract import sampling_rules
from jaxflow_bridge.contract.schedule import cfg_forward_choice
from jaxflow_bridge.engines.vllm_omni import rules as vllm_omni_rules
from jaxflow_bridge.rewards.registry import CONDITIONED, NEED_TARGET, REGISTRY
from jaxflow_bridge.rollout.server import ENGINES


def config_module(path: str | Path) -> ModuleType:
    """A config file (`--config path.py`: its `get_config(...)`, and whatever else it defines) as a module."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PLACED = ("colocated", "split", "in_process")  # the layouts a run takes (jaxflow/config/recipes.py rollout.layout)
LAYOUTS = ("auto", *PLACED)  # rollout.layout: 'auto' is resolved once to one of PLACED (machine.resolve_layout)
LORA_APPLY_CHOICES = ("auto", "merged", "layers", "folder")  # rollout.lora_apply: 'auto' or an engine's lora_apply


def check_layout(cfg, backend: str, devices: int) -> None:
    """After JAX starts: the colocated layout on GPUs runs one engine on each of the trainer's `devices` (all
    processes'), so every GPU both rolls out and trains; fewer engines would leave GPUs idle while the rollout runs."""
    r = cfg.rollout
    if families.of(cfg).one_device and devices != 1:
        fail("model.family", f"{cfg.model.family!r} trains on one device for now (its weights carry no sharding "
                              f"yet); JAX sees {devices}: set CUDA_VISIBLE_DEVICES to one GPU")
    if r.share_weights and (devices != 1 or r.device.partition(":")[0] != {"gpu": "cuda"}.get(backend, backend)):
        fail("rollout.share_weights", f"needs the trainer on one device of the engine's kind: {devices} "
                                       f"{backend} device(s), rollout.device={r.device!r}")
    if engine_per_device(r, backend) and r.num_servers not in ("auto", devices):
        fail("rollout.num_servers", f"{r.num_servers}: the colocated layout runs one engine on each of the trainer's "
                                     f"{devices} GPUs: set --config.rollout.num_servers={devices} (or "
                                     f"rollout.layout='split', the engines on GPUs of their own)")


def needs_target(cfg) -> bool:
    """True when a reward of the run scores a prompt's target text, so every prompt must name one."""
    return bool(NEED_TARGET & set(cfg.reward.fns))


def model_folder(cfg: RunConfig) -> Path:
    """The model folder: a family's tiny one builds or reuses the cached tiny offline model (jaxflow/families/);
    UserError when its cache ($JAXFLOW_CACHE) cannot be written."""
    try:
        return families.of(cfg).folder(cfg)
    except OSError as exc:
        from jaxflow_bridge.rollout.model_cache import CacheUnwritable  # imported by the tiny folders that raise it
        if isinstance(exc, CacheUnwritable):
            raise UserError(str(exc)) from None
        raise


def _check_model(cfg: RunConfig) -> None:
    """model.family, model.path and what the family's trainer and engines support."""
    if cfg.model.family not in families.FAMILIES:
        fail("model.family", f"{cfg.model.family!r}; choose one of {', '.join(families.FAMILIES)}")
    family = families.of(cfg)
    hint = family.tiny_config
    if not cfg.model.path:
        fail("model.path", f"is empty: pass --config.model.path={family.example}, or run {hint}")
    if cfg.model.path != family.tiny:
        folder = Path(cfg.model.path)
        for need in family.files + (family.weights if cfg.model.init == "checkpoint" else ()):
            if not (folder / need).exists():
                fail("model.path", f"{folder} has no {need}: it must be a {family.name} folder; for a run without "
                                    f"weights use {hint}")
        try:
            family.check_folder(folder)
        except ValueError as exc:
            fail("model.path", str(exc))
    if cfg.model.init not in ("checkpoint", "random"):
        fail("model.init", f"{cfg.model.init!r}; choose 'checkpoint' (weights from model.path) or 'random'")
    if cfg.rollout.engine in ENGINES and cfg.rollout.engine not in family.engines:
        fail("rollout.engine", f"{cfg.rollout.engine!r} does not serve model.family={family.name!r}; choose "
                                f"{' or '.join(family.engines)}")
    for key, message in itertools.chain(family.problems(cfg), option_problems(cfg, family), engine_problems(cfg)):
        fail(key, message)
    if cfg.sample.max_think_tokens < 1:
        fail("sample.max_think_tokens", f"{cfg.sample.max_think_tokens!r} must be an int >= 1 (vLLM-Omni's default: "
                                         f"1000)")


def engine_problems(cfg: RunConfig) -> Iterator[Problem]:
    """The rollout engine's rules on the config (the vllm_omni engine's: `vllm_omni_rules.problems`, the one copy its
    engine checks too), on the family's engine keys
    (`Family.engine_config`)."""
    if cfg.rollout.engine != "vllm_omni":
        return
    family, r = families.of(cfg), cfg.rollout
    yield from vllm_omni_rules.problems(family.name, dtype=r.dtype, device=r.device, init=cfg.model.init,
                                        deploy=family.engine_config(cfg).get("deploy"), think=bool(cfg.sample.think))


def _check_prompts(cfg: RunConfig) -> None:
    """The prompt files parse (each error names FILE:LINE and the fix) and data.train holds a step's prompts."""
    for key in ("train", "test"):
        try:
            items = load_prompts(getattr(cfg.data, key), needs_target(cfg))
        except ValueError as exc:
            fail(f"data.{key}", str(exc))
        conditioned = sorted(CONDITIONED & {*cfg.reward.fns, *cfg.eval.rewards})
        plain = next((it for it in items if it.image is None), None)
        if conditioned and plain is not None:
            fail(f"data.{key}", f"{plain.prompt!r} has no source image, but reward(s) {conditioned} score edits "
                                 f"against theirs: use an edit dataset ({{\"image\", \"instruction\", \"target\"}} "
                                 f"rows, e.g. data/edit_signs)")
        untargeted = next((it for it in items if it.target is None), None)
        if CONDITIONED & NEED_TARGET & {*cfg.reward.fns, *cfg.eval.rewards} and untargeted is not None:
            fail(f"data.{key}", f"{untargeted.prompt!r} has no \"target\", which edit-OCR scores: give each row one")
        per_step = cfg.sample.prompts_per_step
        if key == "train" and len(items) < per_step:
            fail("data.train", f"{cfg.data.train} holds {len(items)} prompts, fewer than a step's "
                                f"sample.prompts_per_step={per_step} (distinct prompts): add prompts or pass "
                                f"--config.sample.prompts_per_step={len(items)}")


def validate(user: ConfigDict) -> RunConfig:
    """The validation stage, run once per process start (the command line's preflight, or a Trainer built from a
    ConfigDict): the config's typed sections (`sections.build`), then every rule, the families' (`problems`) and the
    algorithm components' (`rules`, through TrainConfig) included. The first broken one raises its one-line UserError
    naming the key and the fix; touches no model, device or Ray. The rules read the typed sections."""
    cfg = sections.build(user)
    _check_model(cfg)
    layout = cfg.rollout.layout
    if layout not in LAYOUTS:
        fail("rollout.layout", f"{layout!r}; choose one of {LAYOUTS}")
    if cfg.rollout.overlap and layout != "split":
        fail("rollout.overlap", f"runs the next rollout while the trainer trains: it needs rollout GPUs of their own "
                                 f"(rollout.layout='split'), not {layout!r}")
    if cfg.rollout.sleep_while_training and layout == "split":
        fail("rollout.sleep_while_training", "frees the engines' memory for the trainer, which the split layout does "
                                              "not share: leave it False there")
    scored = set(cfg.reward.fns) | set(cfg.eval.rewards)
    actors = sorted(n for n, o in cfg.reward.options.items() if n in scored and "actor" in (o or {}))
    if layout == "in_process" and actors:
        fail(f"reward.options.{actors[0]}.actor", "puts the reward model in a Ray actor; the in_process layout runs "
                                                   "without Ray: drop the option or use rollout.layout='colocated'")
    servers = cfg.rollout.num_servers
    if servers != "auto" and (isinstance(servers, str) or servers < 1):
        fail("rollout.num_servers", f"{servers!r}; give an int >= 1 or 'auto' (colocated on GPUs one engine per "
                                     f"trainer device, else one)")
    if layout == "in_process" and servers not in ("auto", 1):
        fail("rollout.num_servers", f"{servers}: the in_process layout runs one engine, in the "
                                     f"trainer's process; use rollout.layout='colocated' for one per device")
    if cfg.rollout.share_weights:
        if layout != "in_process" or cfg.rollout.engine != "diffusers":
            fail("rollout.share_weights", f"serves the trainer's base weights to an engine in its process: it "
                                           f"needs rollout.layout='in_process' and rollout.engine='diffusers', not "
                                           f"{layout!r} / {cfg.rollout.engine!r}")
        if cfg.rollout.dtype != cfg.model.param_dtype:
            fail("rollout.share_weights", f"the engine runs the trainer's weights as they are: set rollout.dtype "
                                           f"to model.param_dtype ({cfg.model.param_dtype!r}, not "
                                           f"{cfg.rollout.dtype!r})")
        if cfg.rollout.sleep_while_training:
            fail("rollout.share_weights", "the shared weights are the trainer's and cannot sleep: leave "
                                           "rollout.sleep_while_training False")
    if cfg.rollout.lora_apply not in LORA_APPLY_CHOICES:
        fail("rollout.lora_apply", f"{cfg.rollout.lora_apply!r}; choose one of {LORA_APPLY_CHOICES}")
    if cfg.rollout.lora_apply == "merged" and cfg.rollout.engine != "vllm_omni":
        fail("rollout.lora_apply", f"'merged' is a mode of the vllm_omni engine; with rollout.engine="
                                   f"{cfg.rollout.engine!r} use 'auto' or 'layers' (or 'folder')")
    for key, message in vllm_omni_rules.quantization_problems(cfg.rollout.quantization, cfg.rollout.lora_apply):
        fail(key, message)
    if cfg.rollout.quantization != "none" and cfg.rollout.engine != "vllm_omni":
        fail("rollout.quantization", f"{cfg.rollout.quantization!r} is vLLM-Omni's quantized DiT: it needs "
                                      f"rollout.engine='vllm_omni' (a bfloat16 rollout), not "
                                      f"{cfg.rollout.engine!r}; leave it 'none'")
    if cfg.rollout.compile and cfg.rollout.engine != "diffusers":
        fail("rollout.compile", "is an option of the diffusers engine; leave it False with "
                                 f"rollout.engine={cfg.rollout.engine!r}")
    try:
        cfg_forward_choice(cfg.rollout.cfg_forward)
    except ValueError as exc:
        fail("rollout.cfg_forward", str(exc).removeprefix("cfg_forward="))
    if cfg.model.lora_gemm not in ("auto", *LORA_GEMMS):
        fail("model.lora_gemm", f"{cfg.model.lora_gemm!r}; choose one of {('auto', *LORA_GEMMS)}")
    if not isinstance(cfg.model.scan_unroll, int) or cfg.model.scan_unroll < 0:
        fail("model.scan_unroll", f"{cfg.model.scan_unroll!r}: blocks per scan step, >= 1, or 0 (auto: unrolled where "
                                   f"model.lora_gemm runs 'pallas', else 1)")
    if cfg.model.unroll_upgrade not in UNROLL_UPGRADES:
        fail("model.unroll_upgrade", f"{cfg.model.unroll_upgrade!r}; choose one of {UNROLL_UPGRADES}")
    _typed("model", lambda c: model_options(c, "xla", 1), cfg)  # lora_gemm is resolved once JAX runs (lora_gemm)
    if not isinstance(cfg.lora.rank, int) or cfg.lora.rank < 1:
        fail("lora.rank", f"{cfg.lora.rank!r}: the LoRA rank must be an int >= 1")
    if not cfg.lora.alpha > 0:
        fail("lora.alpha", f"{cfg.lora.alpha!r} must be > 0 (the LoRA scale is alpha / rank)")
    _typed("lora", lora_spec, cfg)
    _typed("sharding", sharding_config, cfg)
    xla_options(cfg)
    s, t = cfg.sample, cfg.train
    for key, value, ok, want in (("sample.noise_level", s.noise_level, s.noise_level > 0, "> 0 (the SDE's noise)"),
                                 ("sample.negative_max_sequence_length", s.negative_max_sequence_length,
                                  0 <= s.negative_max_sequence_length <= s.max_sequence_length,
                                  f"in [0, sample.max_sequence_length={s.max_sequence_length}] (0: that length)")):
        if not ok:
            fail(key, f"{value!r} must be {want}")
    device = str(cfg.rollout.device)
    if device not in ("cpu", "cuda") and not (device.startswith("cuda:") and device[5:].isdigit()):
        fail("rollout.device", f"{device!r}; choose 'cpu', 'cuda' or 'cuda:N'")
    if s.group_size < 2:
        fail("sample.group_size", f"{s.group_size}: GRPO needs at least 2 images per prompt")
    if s.prompts_per_step < 1 or s.prompts_per_call < 1 or s.prompts_per_step % s.prompts_per_call:
        fail("sample.prompts_per_call", f"{s.prompts_per_call} must divide prompts_per_step {s.prompts_per_step}")
    batch = s.prompts_per_step * s.group_size
    if t.num_mini_batches < 1 or s.prompts_per_step % t.num_mini_batches:
        fail("train.num_mini_batches", f"{t.num_mini_batches} must divide sample.prompts_per_step "
                                        f"{s.prompts_per_step}: each mini-batch holds whole prompt groups")
    micro = t.num_micro_batches
    if isinstance(micro, str) and micro != "auto":
        fail("train.num_micro_batches", f"{micro!r}; give an int that divides each mini-batch's "
                                         f"{batch // t.num_mini_batches} samples, or 'auto' (the largest micro-batch "
                                         f"that fits)")
    if micro != "auto" and (micro < 1 or (batch // t.num_mini_batches) % micro):
        fail("train.num_micro_batches", f"{micro} must divide each mini-batch's {batch // t.num_mini_batches} "
                                         f"samples (train.num_mini_batches {t.num_mini_batches}), or be 'auto'")
    if not t.max_minutes >= 0:
        fail("train.max_minutes", f"must be >= 0 (0 = no time limit), got {t.max_minutes}")
    if not isinstance(t.max_skipped_steps, int) or t.max_skipped_steps < 0:
        fail("train.max_skipped_steps", f"must be an int >= 0 (0: the first step with a skipped update stops the "
                                         f"run), got {t.max_skipped_steps!r}")
    if not isinstance(t.logp_gate, (int, float)) or isinstance(t.logp_gate, bool) or not t.logp_gate > 0:
        fail("train.logp_gate", f"must be a number > 0 (the bound on p99 |trainer - rollout| log-prob), got "
                                 f"{t.logp_gate!r}")
    if t.logp_gate_steps is not None and (not isinstance(t.logp_gate_steps, int) or isinstance(t.logp_gate_steps, bool)
                                          or t.logp_gate_steps < 0):
        fail("train.logp_gate_steps", f"must be an int >= 0 or None (0 or None: the gate is off), got "
                                       f"{t.logp_gate_steps!r}")
    if not isinstance(t.sync_verify, bool):
        fail("train.sync_verify", f"{t.sync_verify!r} must be a bool: pass True or False")
    if not isinstance(t.sync_fault_from, int) or isinstance(t.sync_fault_from, bool) or t.sync_fault_from < 0:
        fail("train.sync_fault_from", f"must be an int >= 0 (0: no fault injected), got {t.sync_fault_from!r}")
    if s.window_size < 1:
        fail("sample.window_size", f"{s.window_size} must be >= 1: the steps a sample trains (the rollout's 0, "
                                    f"every step but the last, is no training window)")
    if t.algorithm == "nft" and not 0 <= t.nft.timesteps <= s.num_steps:
        fail("train.nft.timesteps", f"{t.nft.timesteps!r} must be in [0, sample.num_steps={s.num_steps}] (0: "
                                     f"DiffusionNFT's int(0.99 num_steps))")
    if t.algorithm == "nft" and t.beta:
        fail("train.beta", f"{t.beta!r}: nft's KL weight is train.nft.kl; leave train.beta 0")
    if s.same_latent and (s.sde_type == "ode" or s.noise_level == 0):
        fail("sample.same_latent", f"True with a deterministic sampler (sde_type {s.sde_type!r}, noise_level "
                                    f"{s.noise_level}) gives a group's images the same pixels and every advantage 0: "
                                    f"pass --config.sample.same_latent=False")
    if not isinstance(cfg.train.drop_zero_advantage, bool):
        fail("train.drop_zero_advantage", f"{cfg.train.drop_zero_advantage!r} must be a bool: pass True or False")
    _typed_train(cfg)
    if s.solver == "dpm2" and s.sde_type != "ode" and not registry.dpm2_after_window(t.algorithm):
        flash = " or ".join(a for a in registry.TABLES["algorithm"] if registry.dpm2_after_window(a))
        ode = " or --config.sample.sde_type=ode" if registry.final_latents(t.algorithm) else ""
        fail("sample.solver", f"'dpm2' with sde_type {s.sde_type!r} is MixGRPO-Flash (dpm2 after the SDE window), "
                              f"for train.algorithm {flash}, not {t.algorithm!r}: pass --config.sample.solver=euler{ode}")
    _check_sampling(cfg)
    unknown = sorted(set(cfg.reward.fns) - set(REGISTRY))
    if unknown or not cfg.reward.fns:
        fail("reward.fns", f"unknown {unknown}; known rewards: {sorted(REGISTRY)}")
    for key in ("train", "test"):
        path = getattr(cfg.data, key)
        if not path or not Path(path).is_file():
            fail(f"data.{key}", f"{path!r} is not a file: pass --config.data.{key}=PROMPTS.txt (one prompt "
                                 f"per line) or .jsonl")
    _check_prompts(cfg)
    if cfg.rollout.engine not in ENGINES:
        fail("rollout.engine", f"{cfg.rollout.engine!r}; choose one of {sorted(ENGINES)}")
    if cfg.profile.num_steps < 0 or cfg.profile.start_step < 1:
        fail("profile", f"start_step {cfg.profile.start_step} must be >= 1 and num_steps {cfg.profile.num_steps} "
                         f">= 0 (0 = no trace)")
    for section, name in (("checkpoint", "every"), ("checkpoint", "keep"), ("train", "num_steps")):
        value = getattr(getattr(cfg, section), name)
        if value < 1:
            fail(f"{section}.{name}", f"must be >= 1, got {value}")
    if cfg.eval.every < 0:
        fail("eval.every", f"must be >= 0 (0: no eval, not even of the final policy), got {cfg.eval.every}")
    _check_gold(cfg)
    _check_wandb(cfg)
    return cfg


def _check_wandb(cfg) -> None:
    """log.wandb, log.wandb_project and log.wandb_mode (jaxflow/run/wandb_log.py)."""
    if cfg.log.wandb_mode not in WANDB_MODES:
        fail("log.wandb_mode", f"{cfg.log.wandb_mode!r}; choose one of {WANDB_MODES}")
    if cfg.log.wandb and not cfg.log.wandb_project:
        fail("log.wandb_project", "is empty: name the wandb project, e.g. --config.log.wandb_project=jaxflow")
    if cfg.log.wandb and importlib.util.find_spec("wandb") is None:
        fail("log.wandb", "True needs the wandb package: pip install wandb (or pass --config.log.wandb=False)")


def _check_gold(cfg) -> None:
    """eval.rewards, eval.best_metric and eval.stop_after (jaxflow/run/gold.py)."""
    e = cfg.eval
    unknown = sorted(set(e.rewards) - set(REGISTRY))
    if unknown:
        fail("eval.rewards", f"unknown {unknown}; known rewards: {sorted(REGISTRY)}")
    if e.best_metric and e.best_metric not in e.rewards:
        fail("eval.best_metric", f"{e.best_metric!r} is not a gold reward: name one of eval.rewards "
                                 f"{sorted(e.rewards)} (add it there), or '' for no lora_best")
    if not isinstance(e.stop_after, int) or isinstance(e.stop_after, bool) or e.stop_after < 0:
        fail("eval.stop_after", f"must be an int >= 0 (0: no early stop), got {e.stop_after!r}")
    if e.stop_after and not e.best_metric:
        fail("eval.stop_after", "watches eval.best_metric: set --config.eval.best_metric to a gold reward's name")


def _typed(section: str, make, cfg):
    """`make(cfg)`, its ValueError (e.g. "ModelOptions.remat='x'; choose one of ...") as the config key's UserError."""
    try:
        return make(cfg)
    except ValueError as exc:
        text = str(exc)
        field, sep, rest = text.partition("=")
        key = field.rpartition(".")[2] if sep and "." in field and " " not in field else None
        fail(f"{section}.{key}" if key else section, rest if key else text)


# the config keys of TrainConfig's checked fields not named train.FIELD (`train_config`), for its errors
TRAIN_KEYS = {"sde_type": "sample.sde_type", "guidance": "sample.guidance", "nft_beta": "train.nft.beta",
              "nft_timesteps": "train.nft.timesteps", "nft_decay": "train.nft"}


def _typed_train(cfg) -> TrainConfig:
    """`train_config(cfg)`; the first rule it breaks (`TrainConfig._rules`, the one place the train step's settings
    are checked) as the config key's UserError."""
    try:
        return train_config(cfg, grid_hw=(1, 1), num_micro_batches=1)  # 'auto' or not: its rule is checked above
    except ValueError as exc:
        field, _, rest = str(exc).removeprefix("TrainConfig.").partition("=")
        fail(TRAIN_KEYS.get(field, f"train.{field}"), rest)


# the config keys of the sampling params' fields (`sampling`), for the rules they break (`sampling_rules.problems`)
SAMPLING_KEYS = {"height": "sample.height", "width": "sample.width", "num_inference_steps": "sample.num_steps",
                 "sde_type": "sample.sde_type", "same_latent": "sample.same_latent",
                 "noise_level": "sample.noise_level", "max_sequence_length": "sample.max_sequence_length",
                 "sde_window_size": "sample.window_size", "solver": "sample.solver"}
EVAL_KEYS = {"num_inference_steps": "eval.num_steps", "solver": "eval.solver"}  # where an eval request's field differs


def _check_sampling(cfg: RunConfig) -> None:
    """The rollout's requests, the training's and the evals', by the rules the engines check them with
    (`sampling_rules.problems`, their one copy); the first broken one as its config key's UserError."""
    multiple = _size_multiple(cfg)
    for eval_mode in (False, True):
        params = SimpleNamespace(**sampling(cfg, eval_mode=eval_mode))
        for field, message in sampling_rules.problems(params, multiple, "the model's VAE factor x 2, the latent "
                                                                        "patch"):
            fail(EVAL_KEYS.get(field, SAMPLING_KEYS[field]) if eval_mode else SAMPLING_KEYS[field], message)


def _size_multiple(cfg) -> int:
    """Image sizes must be multiples of the pixels a latent token covers (the family's `size_multiple`)."""
    try:
        return families.of(cfg).size_multiple(cfg)
    except FileNotFoundError as exc:
        fail("model.path", str(exc))
