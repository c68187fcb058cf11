"""The config's typed sections: one frozen dataclass per section of `recipes.base()`, whose values are the only
defaults (the fields declare types, never defaults). `build(cfg)` types the user's ConfigDict, the first step of
the validation stage (validation.py): a value of the wrong type is one line naming its key. Everything after that
stage reads the RunConfig; only the command line and the validation stage touch the ConfigDict.

The algorithm keys of `train` that this module does not declare (an algorithm component's own section, such as
`train.nft`, or a key an algorithm adds) are kept in `TrainSection.algorithms`, typed by their value in
`recipes.base()`: an algorithm adds its keys to the recipe without a field here, and reads them as attributes of the
section (`cfg.train.nft.kl`, `cfg.train.rollout_rs`)."""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from types import MappingProxyType

from ml_collections import ConfigDict

from jaxflow.config.errors import fail


@dataclasses.dataclass(frozen=True)
class ModelSection:
    family: str
    path: str
    dtype: str
    param_dtype: str
    attention: str
    remat: str
    scan_unroll: int
    matmul_precision: str
    lora_gemm: str
    init: str
    unroll_upgrade: str


@dataclasses.dataclass(frozen=True)
class LoRASection:
    rank: int
    alpha: float
    targets: tuple


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    engine: str
    dtype: str
    device: str
    num_servers: int | str  # 'auto' until the plan stage resolves it (RunPlan.engines)
    num_gpus: float
    num_cpus: float
    max_retries: int
    address: str
    sleep_while_training: bool
    layout: str
    overlap: bool
    compile: bool
    share_weights: bool
    lora_apply: str
    cfg_forward: str
    quantization: str
    bagel_deploy: str
    thinker_memory: float


@dataclasses.dataclass(frozen=True)
class SampleSection:
    height: int
    width: int
    num_steps: int
    guidance: float
    noise_level: float
    sde_type: str
    solver: str
    window_size: int
    window_range: tuple
    negative_prompt: str
    same_latent: bool
    cfg_interval: tuple
    cfg_renorm_min: float
    think: bool
    max_think_tokens: int
    max_sequence_length: int
    negative_max_sequence_length: int
    prompts_per_step: int
    group_size: int
    prompts_per_call: int


@dataclasses.dataclass(frozen=True)
class TrainSection:
    num_steps: int
    compile_cache: bool
    max_minutes: float
    max_skipped_steps: int
    logp_gate: float
    logp_gate_steps: int | None
    sync_verify: bool
    sync_fault_from: int
    num_micro_batches: int | str  # 'auto' until the plan stage resolves it (RunPlan.num_micro_batches)
    learning_rate: float
    clip_range: float
    adv_clip: float
    beta: float
    global_std: bool
    max_grad_norm: float
    weight_decay: float
    ema_decay: float
    adam_b1: float
    adam_b2: float
    adam_eps: float
    old_log_prob: str
    rejection_threshold: float
    ratio_norm: str
    num_mini_batches: int
    num_inner_epochs: int
    drop_zero_advantage: bool
    algorithm: str
    xla_options: Mapping
    algorithms: Mapping  # the algorithm components' own keys (e.g. "nft": its section), typed by recipes.base()

    def __getattr__(self, name: str):
        """An algorithm component's key (`train.rollout_rs`) or section (`train.nft`, a `Keys`)."""
        if name.startswith("__") or name == "algorithms":
            raise AttributeError(name)
        try:
            return self.algorithms[name]
        except KeyError:
            raise AttributeError(f"train.{name} is not a config key (jaxflow/config/recipes.py base())") from None


@dataclasses.dataclass(frozen=True)
class RewardSection:
    fns: Mapping
    options: Mapping
    workers: int

    def options_dict(self) -> dict:
        """reward.options as plain dicts: name -> its options (what `build_reward` takes)."""
        return thawed(self.options)


@dataclasses.dataclass(frozen=True)
class DataSection:
    train: str
    test: str


@dataclasses.dataclass(frozen=True)
class EvalSection:
    every: int
    num_prompts: int
    num_steps: int
    guidance: float
    solver: str
    rewards: Mapping
    best_metric: str
    stop_after: int


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    every: int
    keep: int


@dataclasses.dataclass(frozen=True)
class ShardingSection:
    data: int
    fsdp: int
    tensor: int
    rules: tuple


@dataclasses.dataclass(frozen=True)
class LogSection:
    tensorboard: bool
    progress: bool
    wandb: bool
    wandb_project: str
    wandb_mode: str


@dataclasses.dataclass(frozen=True)
class ProfileSection:
    start_step: int
    num_steps: int
    dir: str


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The validated config: its typed sections, what everything after the validation stage reads."""

    seed: int
    run_dir: str
    model: ModelSection
    lora: LoRASection
    rollout: RolloutSection
    sample: SampleSection
    train: TrainSection
    reward: RewardSection
    data: DataSection
    eval: EvalSection
    checkpoint: CheckpointSection
    sharding: ShardingSection
    log: LogSection
    profile: ProfileSection

    def to_dict(self) -> dict:
        """The config as the plain nested dict the user's ConfigDict's `to_dict()` gives (the train section's
        algorithm keys back among its own): the run's config.json and checkpoints hold it."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                fields = {g.name: thawed(getattr(value, g.name)) for g in dataclasses.fields(value)}
                algorithms = fields.pop("algorithms", {})
                value = {**fields, **algorithms}
            out[f.name] = thawed(value)
        return out


def _name(kind) -> str:
    return " or ".join(_NAMES[k] for k in typing.get_args(kind)) if isinstance(kind, types.UnionType) else _NAMES[kind]


_NAMES = {int: "an int", float: "a float", bool: "a bool", str: "a str", tuple: "a list or tuple",
          Mapping: "a dict"}


def _is(value, kind) -> bool:
    if isinstance(kind, types.UnionType):
        return any(_is(value, k) for k in typing.get_args(kind))
    if kind is bool:
        return isinstance(value, bool)
    if kind in (int, float):  # an int is a float too; a bool is neither
        return isinstance(value, int if kind is int else (int, float)) and not isinstance(value, bool)
    if kind is Mapping:
        return isinstance(value, (dict, ConfigDict))
    return isinstance(value, (tuple, list) if kind is tuple else kind)


class Keys(Mapping):
    """An algorithm component's own section of `train` (`train.nft`), read-only; its keys read as attributes too."""

    def __init__(self, values: Mapping):
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str):
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(f"cannot assign to {name}: the config is read-only after validation")

    def __getitem__(self, name):
        return self._values[name]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Keys({self._values!r})"

    def __reduce__(self):
        return Keys, (self._values,)


def _frozen(value):
    """A section's value made immutable: lists as tuples, dicts as read-only plain dicts."""
    if isinstance(value, ConfigDict):
        value = value.to_dict()
    if isinstance(value, dict):
        return MappingProxyType({k: _frozen(v) for k, v in value.items()})
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


def thawed(value):
    """A frozen value as plain Python: read-only mappings as dicts (tuples stay tuples, as in a ConfigDict)."""
    if isinstance(value, Mapping):
        return {k: thawed(v) for k, v in value.items()}
    return tuple(thawed(v) for v in value) if isinstance(value, tuple) else value


def _typed(key: str, value, kind):
    """`value` of config key `key` if it is of `kind`, frozen; else the key's one-line error."""
    if not _is(value, kind):
        fail(key, f"{value!r} must be {_name(kind)} (it is {'None' if value is None else type(value).__name__})")
    return _frozen(value)


@functools.cache
def _recipe_types() -> dict:
    """The type of every key of `recipes.base()` (the defaults' one place), for the keys no section declares."""
    from jaxflow.config.recipes import base, config_keys, config_value
    cfg = base()
    kinds = {bool: bool, int: int, float: float, str: str, list: tuple, tuple: tuple, dict: Mapping}
    return {key: kinds[type(config_value(cfg, key))] for key in config_keys(cfg)}


def _algorithms(prefix: str, values: Mapping) -> Mapping:
    """The undeclared keys of `train` (the algorithm components'), each typed by its value in the recipe."""
    types, out = _recipe_types(), {}
    for name, value in values.items():
        key = prefix + name
        if isinstance(value, (dict, ConfigDict)) and key not in types:
            out[name] = Keys(_algorithms(key + ".", value))
        else:
            out[name] = _typed(key, value, types[key]) if key in types else _frozen(value)
    return MappingProxyType(out)


def _section(cls, key: str, values):
    if not isinstance(values, (dict, ConfigDict)):
        fail(key, f"{values!r} must be a section (a dict of its keys)")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    missing = sorted(fields - set(values) - {"algorithms"})
    if missing:
        fail(f"{key}.{missing[0]}", f"is missing: a config builds on jaxflow/config/recipes.py base(), which sets "
                                    f"every key")
    kwargs = {name: _typed(f"{key}.{name}", values[name], hints[name]) for name in fields if name != "algorithms"}
    if "algorithms" in fields:
        kwargs["algorithms"] = _algorithms(key + ".", {n: values[n] for n in values if n not in fields})
    return cls(**kwargs)


def build(cfg: ConfigDict) -> RunConfig:
    """`cfg` as typed sections; UserError "config.KEY: VALUE must be an int (it is str)" for the first value of a
    wrong type."""
    hints = typing.get_type_hints(RunConfig)
    kwargs = {}
    for f in dataclasses.fields(RunConfig):
        if f.name not in cfg:
            fail(f.name, "is missing: a config builds on jaxflow/config/recipes.py base(), which sets every key")
        kind = hints[f.name]
        kwargs[f.name] = (_section(kind, f.name, cfg[f.name]) if dataclasses.is_dataclass(kind)
                          else _typed(f.name, cfg[f.name], kind))
    return RunConfig(**kwargs)

