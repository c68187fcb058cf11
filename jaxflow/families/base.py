"""The `Family` protocol: what the training program asks of a model family (`model.family`), and the checks every
family shares (`option_problems`). Each family lives in a folder of its own beside this module and is registered in
`jaxflow/families/__init__.py`; the generic trainer modules reach a family only through this protocol."""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Iterator, Protocol

from jaxflow.algorithms.objective import Objective
from jaxflow.config.sections import RunConfig
from jaxflow.nn.lora import LoRASpec
from jaxflow.nn.weights import TensorSource

Problem = tuple[str, str]  # (config key, message) of a setting the family refuses


class Family(Protocol):
    """A model family. Its folder holds the model, its checkpoint key map and loading, its CFG forward and
    log-prob (`objective`), its LoRA targets and the config checks below."""

    name: str
    engines: tuple[str, ...]  # the rollout engines that serve it
    auto_lora_apply: Mapping[str, str]  # rollout.lora_apply='auto' on each of its engines: 'layers', 'merged', 'folder'
    tiny: str  # model.path of its tiny offline model
    tiny_config: str  # the config that runs it
    example: str  # an example model.path
    files: tuple[str, ...]  # what a model folder must hold
    weights: tuple[str, ...]  # what it must hold with model.init='checkpoint'
    one_device: bool  # trains on one device only (its weights carry no sharding yet)
    stages: tuple[str, ...]  # the rollout.bagel_deploy values its vllm_omni rollout runs
    thinks: bool  # has a think mode (sample.think)
    fused_gemm: bool  # its layers call the fused LoRA GEMM (model.lora_gemm='pallas'; the plan resolves 'auto')
    upgrades: bool  # its model swaps to unrolled blocks mid-run (model.unroll_upgrade: abstract_unrolled, unroll)
    lora_spec_type: type[LoRASpec]  # its LoRA spec's class
    config_type: type  # its model config's class (the model's sizes)
    model_type: type  # its model's class: model_type(config, opts, lora_spec, rngs=...)

    def folder(self, cfg: RunConfig) -> Path: ...
    def check_folder(self, folder: Path) -> None: ...
    def problems(self, cfg: RunConfig) -> Iterator[Problem]: ...
    def size_multiple(self, cfg: RunConfig) -> int: ...
    def grid_hw(self, folder: Path, cfg: RunConfig) -> tuple[int, int]: ...
    def image_tokens(self, folder: Path, cfg: RunConfig) -> int: ...  # a sample's image tokens: target + conditioning
    def lora_spec(self, cfg: RunConfig) -> LoRASpec: ...
    def weights_source(self, folder: Path) -> tuple[TensorSource, int]: ...
    def random_weights(self, folder: Path) -> list[tuple[str, tuple[int, ...], int]]: ...  # model.init=random
    def num_layers(self, folder: Path) -> int: ...
    def build_model(self, cfg: RunConfig, folder: Path, spec, opts, **kw): ...
    def abstract_unrolled(self, model, opts): ...  # model as `unroll` leaves it, arrays as ShapeDtypeStructs
    def unroll(self, model, opts) -> None: ...  # model runs `opts`' unrolled blocks from now on
    def owns(self, model) -> bool: ...
    def objective(self, config) -> Objective: ...
    def batch_shape(self, model) -> dict: ...
    def save_peft(self, lora, spec, directory: Path) -> None: ...
    def fingerprint(self, model) -> str: ...
    def engine_config(self, cfg: RunConfig) -> dict: ...
    def sampling(self, cfg: RunConfig, eval_mode: bool) -> dict: ...
    def vision_tokens(self, cfg: RunConfig) -> int: ...  # prompt tokens its conditioning images add (0: text only)


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


def option_problems(cfg: RunConfig, family: Family) -> Iterator[Problem]:
    """vLLM-Omni's two-stage deployment and think mode against what `family` runs (after its own `problems`; the
    vllm_omni engine's own rules on them: `validation.engine_problems`)."""
    from jaxflow import families  # the registry imports this module

    deploys = tuple(dict.fromkeys(s for name in families.FAMILIES for s in families.by_name(name).stages))
    deploy = cfg.rollout.bagel_deploy
    if deploy not in deploys:
        yield "rollout.bagel_deploy", f"{deploy!r}; choose one of {deploys}"
    if deploy != "single_stage" and (deploy not in family.stages or cfg.rollout.engine != "vllm_omni"):
        yield "rollout.bagel_deploy", (f"{deploy!r} is vLLM-Omni's BAGEL topology; with model.family={family.name!r} "
                                       f"and rollout.engine={cfg.rollout.engine!r} leave it 'single_stage'")
    if not 0.0 <= cfg.rollout.thinker_memory < 1.0 or (cfg.rollout.thinker_memory and deploy != "two_stage"):
        yield "rollout.thinker_memory", (f"{cfg.rollout.thinker_memory!r}: the two-stage thinker's share of the GPU "
                                         f"in (0, 1) with rollout.bagel_deploy='two_stage', or 0.0 for bagel.yaml's")
    if cfg.sample.think and not family.thinks:
        yield "sample.think", (f"True is BAGEL's think mode; model.family={family.name!r} has none: pass "
                               f"--config.sample.think=False")
