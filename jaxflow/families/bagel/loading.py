"""BagelModel <-> arrays keyed by Flax path (bagel_keymap.to_flax / to_checkpoint convert those to and from the
checkpoint's names), and a BAGEL folder's model (`load_bagel`)."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxflow.families.bagel.config import BagelConfig
from jaxflow.families.bagel.model import BagelModel
from jaxflow.nn.config import ModelOptions
from jaxflow.nn.lora import LoRAParam, LoRASpec
from jaxflow.nn.random_init import entry_value
from jaxflow.nn.weights import state_leaf
from jaxflow_bridge.contract import safetensors_io
from jaxflow_bridge.families.bagel import keymap as bagel_keymap


def init_lora(cfg: BagelConfig, opts: ModelOptions, lora: LoRASpec, seed: int = 0) -> nnx.State:
    """Fresh LoRA params (PEFT gaussian init: B = 0); XLA drops the unused base initialisation."""
    return jax.jit(lambda: nnx.state(BagelModel(cfg, opts, lora, rngs=nnx.Rngs(seed)), LoRAParam))()


def _assemble(cfg: BagelConfig, opts: ModelOptions, lora: LoRASpec | None, seed: int, value,
              check=None) -> BagelModel:
    """The model with every key-map leaf set to `value(entry, abstract_var)` (after `check(abstract state)`, if
    given) and, with `lora`, fresh adapters from `seed` on the generation expert. Shared by `build` and
    `random_bagel`."""
    abstract = nnx.eval_shape(lambda: BagelModel(cfg, opts, lora, rngs=nnx.Rngs(seed)))
    graphdef, lora_state, state = nnx.split(abstract, LoRAParam, ...)
    entries = bagel_keymap.key_map()
    params = {path for path, _ in nnx.to_flat_state(nnx.filter_state(state, nnx.Param))}
    if params != {e.flax_path for e in entries}:
        raise ValueError(f"BagelModel parameters and the key map differ: "
                         f"{sorted(params ^ {e.flax_path for e in entries})}")
    if check is not None:
        check(state)
    for e in entries:
        var = state_leaf(state, e.flax_path)
        var.set_value(value(e, var))
    if lora is not None:
        lora_state = init_lora(cfg, opts, lora, seed)
    return nnx.merge(graphdef, lora_state, state)


def build(cfg: BagelConfig, arrays: dict[tuple[str, ...], np.ndarray], opts: ModelOptions = ModelOptions(),
          lora: LoRASpec | None = None, seed: int = 0) -> BagelModel:
    """A BagelModel holding `arrays` in its storage dtype (every parameter must be given, at its shape) and, with
    `lora`, fresh adapters from `seed` on the generation expert."""
    def check(state):
        problems = []
        for e in bagel_keymap.key_map():
            var, given = state_leaf(state, e.flax_path), arrays.get(e.flax_path)
            if given is None or tuple(given.shape) != tuple(var.shape):
                problems.append(f"{'/'.join(e.flax_path)}: got {None if given is None else given.shape}, "
                                f"model {var.shape}")
        if problems:
            raise ValueError(f"arrays do not fit BagelModel: {problems}")

    return _assemble(cfg, opts, lora, seed, lambda e, var: jnp.asarray(arrays[e.flax_path], opts.storage_dtype), check)


def arrays(model: BagelModel) -> dict[tuple[str, ...], np.ndarray]:
    """The model's parameters as numpy arrays keyed by Flax path (the inverse of `build`)."""
    state = nnx.state(model, nnx.Param)
    return {e.flax_path: np.asarray(state_leaf(state, e.flax_path)[...]) for e in bagel_keymap.key_map()}


def folder_config(folder: str | Path) -> BagelConfig:
    """The geometry of a BAGEL folder: llm_config.json, config.json, and the markers' ids from tokenizer.json."""
    folder = Path(folder)
    added = {t["content"]: t["id"] for t in json.loads((folder / "tokenizer.json").read_text())["added_tokens"]}
    return BagelConfig.from_dicts(json.loads((folder / "llm_config.json").read_text()),
                                  json.loads((folder / "config.json").read_text()),
                                  vision_start_id=added["<|vision_start|>"], vision_end_id=added["<|vision_end|>"])


def load_bagel(folder: str | Path, opts: ModelOptions = ModelOptions(), lora: LoRASpec | None = None,
               seed: int = 0) -> BagelModel:
    """The generation path of a BAGEL folder: `folder_config` and ema.safetensors under the checkpoint's names
    (the ignored ones dropped: LM head, ViT, ...), with fresh adapters from `seed` when `lora` is given."""
    cfg = folder_config(folder)
    source = safetensors_io.SafetensorsFile(Path(folder) / "ema.safetensors")
    tensors = {k: source.get(k) for k in source.keys() if not k.startswith(bagel_keymap.IGNORED_PREFIXES)}
    return build(cfg, bagel_keymap.to_flax(tensors, cfg.num_hidden_layers), opts, lora, seed)


def random_bagel(cfg: BagelConfig, opts: ModelOptions = ModelOptions(), lora: LoRASpec | None = None,
                 seed: int = 0) -> BagelModel:
    """The generation path with the shared random base weights (jaxflow_bridge/contract/random_weights.py) drawn on
    the device by checkpoint name, as the bagel_torch engine draws them from `random_seed`; fresh adapters from
    `seed` with `lora`."""
    return _assemble(cfg, opts, lora, seed, lambda e, var: entry_value(seed, cfg.num_hidden_layers, e, var, None))
