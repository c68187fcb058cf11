"""JAX side of `jaxflow_bridge/contract/random_weights.py`: a key-map entry's value by the shared random spec, drawn
on device straight into the leaf's sharding (the rollout draws the same in torch; the fingerprint check compares).
Each family's random model assembles these over its key map."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow_bridge.contract.random_weights import FMIX, GOLDEN, key_id, kind, scale
from jaxflow_bridge.contract.weight_keys import Entry


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


def entry_value(seed: int, num_layers: int, e: Entry, var, sharding) -> jax.Array:
    """The value of key-map entry `e` (abstract leaf `var`, its layers stacked when `e.stacked`) by the shared spec,
    drawn on the device into `sharding`: the torch tensors of its checkpoint names, in Flax layout. The names' key
    ids are the program's argument (`_program`), so entries of one shape share one compile, whatever the seed."""
    names, shape = e.diffusers_keys(num_layers), tuple(var.shape)
    torch_shape = e.torch_shape(shape)
    ids = np.array([key_id(seed, n) for n in names], np.uint32)
    draw = _program(kind(names[0], torch_shape), shape, torch_shape, e.transpose, e.stacked, np.dtype(var.dtype),
                    sharding)
    return draw(ids)


@functools.cache
def _program(k: str, shape: tuple, torch_shape: tuple, transpose: bool, stacked: bool, dtype, sharding):
    """The jit drawing an entry of kind `k` ("uniform", "ones" or "zeros") from its names' key ids."""
    def draw(ids):
        if k != "uniform":
            return (jnp.ones if k == "ones" else jnp.zeros)(shape, dtype)
        w = _uniform(ids, torch_shape, transpose, dtype)
        return w if stacked else w[0]
    return jax.jit(draw, out_shardings=sharding) if sharding is not None else jax.jit(draw)
