"""The trainer's frozen base weights as torch tensors for an engine in its process (the trainer's glue; JAX and torch
meet here, as in jaxflow/sync/lora_sync.py).

With `rollout.share_weights` the diffusers engine in the trainer's process builds its transformer without weights
and serves these instead (jaxflow_bridge/rollout/shared_weights.py): each diffusers tensor is a DLPack view of the
JAX array that holds it (one block's slice of a stack, a kernel transposed as a view), so the 20B base weights sit
on the device once. Aliasing: the base is frozen (never updated, never donated by the train step) and the engine
only reads it; the views keep their buffers alive for as long as the engine holds them.
"""
from __future__ import annotations

from flax import nnx

from jaxflow.sync.lora_sync import jax_to_torch
from jaxflow.nn.weights import state_leaf
from jaxflow import families
from jaxflow_bridge.engines import families as torch_families


def torch_base_weights(model) -> dict:
    """{diffusers key: torch.Tensor} of `model`'s base weights (a transformer on one device whose family's key map,
    its torch folder's keymap.py, lists diffusers keys), views of its arrays in torch's layout (torch (out, in) weights
    as transposed views of the (in, out) kernels)."""
    keymap = torch_families.module(families.of_model(model).name, "keymap")
    base = nnx.state(model, nnx.Param)
    out = {}
    for e in keymap.transformer_key_map():
        value = state_leaf(base, e.flax_path).get_value()
        if not e.stacked:
            layers = [jax_to_torch(value)]
        elif isinstance(value, tuple):  # one array per block (unrolled blocks, `unstack_blocks`)
            layers = [jax_to_torch(v) for v in value]
        else:
            layers = jax_to_torch(value).unbind(0)
        for key, t in zip(e.diffusers_keys(model.cfg.num_layers), layers, strict=True):
            out[key] = t.t() if e.transpose else t
    return out
