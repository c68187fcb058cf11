"""Load/save a diffusers-format `transformer/` folder through the declarative key map (keymap.py).

Tensors are read one by one from memory-mapped safetensors (bf16 stays bf16) and placed directly with the
requested sharding; everything is checked before anything is placed, so a bad folder loads nothing.
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxflow.families.qwen_image.transformer import QwenImageTransformer
from jaxflow.families.qwen_image.config import QwenImageConfig
from jaxflow.nn.config import ModelOptions
from jaxflow.nn.lora import LoRAParam, LoRASpec, merged_kernels
from jaxflow_bridge.contract import safetensors_io
from jaxflow.nn.weights import INDEX, WEIGHTS, ShardingFn, TensorSource, entries_fingerprint, report, state_leaf
from jaxflow_bridge.families.qwen_image import keymap


def _check(source: TensorSource, entries, abstract: nnx.State, num_layers: int) -> None:
    problems, expected = [], set()
    for e in entries:
        var = state_leaf(abstract, e.flax_path)
        want = e.torch_shape(var.shape)
        for key in e.diffusers_keys(num_layers):
            expected.add(key)
            if key not in source.keys():
                problems.append(f"missing {key}")
            elif source.shape(key) != want:
                problems.append(f"shape {key}: checkpoint {source.shape(key)}, model {want}")
    problems += [f"unexpected {k}" for k in sorted(source.keys() - expected)]
    report(problems, "checkpoint does not match the Qwen-Image model")


def _host_value(source: TensorSource, e: keymap.Entry, num_layers: int, dtype) -> np.ndarray:
    def one(key):
        t = source.get(key)
        t = t.T if e.transpose else t
        return t if t.dtype == dtype else t.astype(dtype)

    keys = e.diffusers_keys(num_layers)
    if not e.stacked:
        return np.ascontiguousarray(one(keys[0]))
    first = one(keys[0])
    out = np.empty((num_layers, *first.shape), dtype)
    out[0] = first
    for i, key in enumerate(keys[1:], start=1):
        out[i] = one(key)
    return out


def _place(host: np.ndarray, sharding) -> jax.Array:
    if sharding is None:
        return jnp.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def init_lora(cfg: QwenImageConfig, opts: ModelOptions, lora: LoRASpec, seed: int) -> nnx.State:
    """Fresh LoRA params (PEFT gaussian init); XLA drops the unused base initialisation."""
    return jax.jit(lambda: nnx.state(QwenImageTransformer(cfg, opts, lora, rngs=nnx.Rngs(seed)), LoRAParam))()


def assemble(cfg: QwenImageConfig, opts: ModelOptions, lora: LoRASpec | None, seed: int,
             sharding: ShardingFn | None, value, check=None,
             model_type: type[QwenImageTransformer] = QwenImageTransformer) -> QwenImageTransformer:
    """The `model_type` model (Qwen-Image's transformer or a subclass with its weights: the edit model) with every
    base leaf set to `value(entry, abstract_var, leaf_sharding)` (after `check(abstract base state)`, if given) and
    a fresh LoRA from `seed` if `lora`. Shared by checkpoint loading and random init."""
    abstract = nnx.eval_shape(lambda: model_type(cfg, opts, lora, rngs=nnx.Rngs(seed)))
    graphdef, base, lora_state, rest = nnx.split(abstract, nnx.Param, LoRAParam, ...)
    if check is not None:
        check(base)
    for e in keymap.transformer_key_map():
        var = state_leaf(base, e.flax_path)
        shard = sharding(e.flax_path, var.get_metadata().get("logical_axes"), var.shape) if sharding else None
        var.set_value(value(e, var, shard))
    if lora is not None:
        lora_state = init_lora(cfg, opts, lora, seed)
    return nnx.merge(graphdef, base, lora_state, rest)


def checkpoint_shapes(cfg: QwenImageConfig, model_type: type[QwenImageTransformer] = QwenImageTransformer
                      ) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """(diffusers key, torch shape, dtype) of every base tensor the model of `cfg` reads from a checkpoint, from its
    config alone (an abstract model, nothing allocated): what a folder without weights (model.init=random) holds.
    Attention is named ('xla': shapes do not depend on it) so that nothing asks JAX for its backend: the plan stage
    calls this before JAX starts, and a started JAX would have taken its default memory share, not the plan's."""
    abstract = nnx.eval_shape(lambda: model_type(cfg, ModelOptions(attention="xla"), None, rngs=nnx.Rngs(0)))
    base = nnx.state(abstract, nnx.Param)
    out = []
    for e in keymap.transformer_key_map():
        var = state_leaf(base, e.flax_path)
        out += [(name, e.torch_shape(var.shape), np.dtype(var.dtype)) for name in e.diffusers_keys(cfg.num_layers)]
    return out


def build_from_source(cfg: QwenImageConfig, source: TensorSource, opts: ModelOptions = ModelOptions(),
                      lora: LoRASpec | None = None, *, sharding: ShardingFn | None = None, seed: int = 0,
                      model_type: type[QwenImageTransformer] = QwenImageTransformer) -> QwenImageTransformer:
    """Create the model with base weights from `source` (fresh LoRA if `lora`), checking everything first."""
    return assemble(cfg, opts, lora, seed, sharding,
                    lambda e, var, shard: _place(_host_value(source, e, cfg.num_layers, np.dtype(var.dtype)), shard),
                    check=lambda base: _check(source, keymap.transformer_key_map(), base, cfg.num_layers),
                    model_type=model_type)


def load_transformer(folder: str | Path, opts: ModelOptions = ModelOptions(), lora: LoRASpec | None = None, *,
                     sharding: ShardingFn | None = None, seed: int = 0,
                     model_type: type[QwenImageTransformer] = QwenImageTransformer) -> QwenImageTransformer:
    """Load a diffusers `transformer/` folder (config.json + single or index-sharded safetensors)."""
    folder = Path(folder)
    cfg = QwenImageConfig.from_json(folder / "config.json")
    return build_from_source(cfg, TensorSource.from_folder(folder), opts, lora, sharding=sharding, seed=seed,
                             model_type=model_type)


def to_diffusers_state_dict(model: QwenImageTransformer, merge_lora: bool = False) -> dict[str, np.ndarray]:
    """The base weights under diffusers keys (torch layout), optionally with the LoRA folded in."""
    base = nnx.state(model, nnx.Param)
    merged = merged_kernels(model) if merge_lora else {}
    out = {}
    for e in keymap.transformer_key_map():
        value = merged.get(e.flax_path)
        if value is None:  # a stack, or one array per block (unstack_blocks)
            value = np.asarray(state_leaf(base, e.flax_path).get_value())
        layers = value if e.stacked else value[None]
        for key, layer in zip(e.diffusers_keys(model.cfg.num_layers), layers):
            out[key] = np.ascontiguousarray(layer.T if e.transpose else layer)
    return out


def fingerprint(model: QwenImageTransformer) -> str:
    """sha256 of the base weights, equal to the rollout's `weights_fingerprint` for the same checkpoint
    (`entries_fingerprint` over the diffusers key map)."""
    return entries_fingerprint(nnx.state(model, nnx.Param), keymap.transformer_key_map(), model.cfg.num_layers)


def save_transformer(model: QwenImageTransformer, folder: str | Path, *, merge_lora: bool = False,
                     max_shard_bytes: int = 5 * 2 ** 30) -> Path:
    """Write config.json + safetensors (index-sharded above `max_shard_bytes`) in diffusers' format."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.cfg.to_dict(), indent=2))
    tensors = to_diffusers_state_dict(model, merge_lora)
    shards, size = [{}], 0
    for key in sorted(tensors):
        if size and size + tensors[key].nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensors[key]
        size += tensors[key].nbytes
    if len(shards) == 1:
        safetensors_io.save(shards[0], folder / WEIGHTS)
        return folder
    weight_map = {}
    for n, shard in enumerate(shards, start=1):
        name = f"diffusion_pytorch_model-{n:05d}-of-{len(shards):05d}.safetensors"
        safetensors_io.save(shard, folder / name)
        weight_map.update({k: name for k in shard})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
    return folder
