"""The one attention function: cuDNN flash attention on GPU, XLA elsewhere, chosen explicitly."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def resolve_implementation(name: str) -> str:
    """'auto' -> 'cudnn' when the default backend is a GPU, else 'xla'. Never falls back silently later."""
    if name == "auto":
        return "cudnn" if jax.default_backend() == "gpu" else "xla"
    if name not in ("xla", "cudnn"):
        raise ValueError(f"attention implementation {name!r}; choose 'auto', 'xla' or 'cudnn'")
    return name


def attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_len: jax.Array | None, implementation: str) -> jax.Array:
    """Non-causal attention over (B, S, H, D) with the first kv_len[b] keys visible (None = all).

    Callers order the joint sequence so that the only masked keys (text padding) are a suffix; this lets
    cuDNN use its padding mask instead of a dense bias.
    """
    if implementation == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=kv_len, implementation="cudnn")
    mask = None
    if kv_len is not None:
        mask = (jnp.arange(k.shape[1])[None, :] < kv_len[:, None])[:, None, None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
