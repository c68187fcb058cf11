"""JAX side of `bridge/random_weights.py`: the transformer with the shared random base weights, drawn on device
straight into each leaf's sharding (the rollout draws the same in torch; the fingerprint check compares)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bridge.random_weights import FMIX, GOLDEN, key_id, kind, scale
from jaxflow.models import keymap
from jaxflow.models.config import ModelOptions, QwenImageConfig
from jaxflow.models.loading import ShardingFn, _leaf, init_lora
from jaxflow.models.lora import LoRAParam, LoRASpec
from jaxflow.models.transformer import QwenImageTransformer


def _uniform(key_ids: jax.Array, torch_shape: tuple[int, ...], transpose: bool, dtype) -> jax.Array:
    """One weight per key id, (len(key_ids), *shape) with shape in Flax layout."""
    def one(kid):
        x = jnp.arange(math.prod(torch_shape), dtype=jnp.uint32) * jnp.uint32(GOLDEN) + kid
        x = (x ^ (x >> 16)) * jnp.uint32(FMIX[0])
        x = (x ^ (x >> 13)) * jnp.uint32(FMIX[1])
        x = x ^ (x >> 16)
        w = ((x >> 8).astype(jnp.int32) - 2 ** 23).astype(jnp.float32) * scale(torch_shape)
        w = w.reshape(torch_shape)
        return (w.T if transpose else w).astype(dtype)
    return jax.lax.map(one, key_ids)


def _value(e: keymap.Entry, names: list[str], shape, dtype, seed: int, sharding) -> jax.Array:
    per_layer = shape[1:] if e.stacked else shape
    torch_shape = tuple(per_layer[::-1]) if e.transpose else tuple(per_layer)
    k = kind(names[0], torch_shape)

    def draw():
        if k != "uniform":
            return (jnp.ones if k == "ones" else jnp.zeros)(shape, dtype)
        ids = jnp.asarray(np.array([key_id(seed, n) for n in names], np.uint32))
        w = _uniform(ids, torch_shape, e.transpose, dtype)
        return w if e.stacked else w[0]
    return jax.jit(draw, out_shardings=sharding)() if sharding is not None else jax.jit(draw)()


def random_transformer(cfg: QwenImageConfig, opts: ModelOptions = ModelOptions(), lora: LoRASpec | None = None,
                       *, sharding: ShardingFn | None = None, seed: int = 0) -> QwenImageTransformer:
    """The model with base weights drawn by the shared spec from `seed` (fresh LoRA from `seed` if `lora`)."""
    abstract = nnx.eval_shape(lambda: QwenImageTransformer(cfg, opts, lora, rngs=nnx.Rngs(seed)))
    graphdef, base, lora_state, rest = nnx.split(abstract, nnx.Param, LoRAParam, ...)
    for e in keymap.transformer_key_map():
        var = _leaf(base, e.flax_path)
        shard = sharding(e.flax_path, var.get_metadata().get("logical_axes"), var.shape) if sharding else None
        var.set_value(_value(e, e.diffusers_keys(cfg.num_layers), var.shape, var.dtype, seed, shard))
    if lora is not None:
        lora_state = init_lora(cfg, opts, lora, seed)
    return nnx.merge(graphdef, base, lora_state, rest)
