"""The one attention function: cuDNN flash attention for bf16/fp16 on GPU, XLA otherwise, chosen explicitly."""
from __future__ import annotations

import jax
import jax.numpy as jnp


CUDNN_DTYPES = ("bfloat16", "float16")  # cuDNN's fused attention refuses float32 inputs


def resolve_implementation(name: str, dtype: str) -> str:
    """'auto' -> 'cudnn' for bf16/fp16 compute on a GPU, else 'xla'; 'cudnn' with float32 (or off a GPU) is refused
    here, at model construction, rather than failing inside jit. Never falls back silently later. JAX's backend is
    asked only where the answer depends on it ('xla' starts nothing: the plan stage sizes models before JAX starts)."""
    if name not in ("auto", "xla", "cudnn"):
        raise ValueError(f"attention implementation {name!r}; choose 'auto', 'xla' or 'cudnn'")
    if name == "xla":
        return name
    on_gpu = jax.default_backend() == "gpu"
    if name == "auto":
        return "cudnn" if on_gpu and dtype in CUDNN_DTYPES else "xla"
    if dtype not in CUDNN_DTYPES or not on_gpu:
        raise ValueError(f"attention='cudnn' needs a GPU and compute dtype in {CUDNN_DTYPES} (got {dtype} on "
                         f"{jax.default_backend()}); use attention='auto' or 'xla'")
    return name


def attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_len: jax.Array | None, implementation: str,
              causal: bool = False) -> jax.Array:
    """Attention over (B, S, H, D) with the first kv_len[b] keys visible (None = all); k/v may have fewer heads (GQA,
    H a multiple of theirs). causal: query i sees keys <= i (a prefill: same length, kv_len None).

    Callers order the joint sequence so that the only masked keys (text padding) are a suffix; this lets
    cuDNN use its padding mask instead of a dense bias.
    """
    if implementation == "cudnn":
        s = q.shape[1]
        if s % 2:  # cuDNN's backward with a padding mask takes even lengths: one masked key (query dropped) more
            q, k, v = (jnp.pad(t, ((0, 0), (0, 1), (0, 0), (0, 0))) for t in (q, k, v))
            kv_len = jnp.full((q.shape[0],), s, jnp.int32) if kv_len is None else kv_len
        o = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=kv_len, is_causal=causal,
                                         implementation="cudnn")
        return o[:, :s]
    mask = None
    if kv_len is not None:
        mask = (jnp.arange(k.shape[1])[None, :] < kv_len[:, None])[:, None, None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation="xla")
