"""BAGEL's mixture-of-transformers decoder layer: every weight twice (understanding and generation experts), each
token routed to one expert by a static boolean "is generation token" mask, one GQA attention over all tokens."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxflow.nn.attention import attention
from jaxflow.families.bagel.config import BagelConfig
from jaxflow.families.bagel.embeddings import apply_rope
from jaxflow.nn.config import ModelOptions
from jaxflow.families.bagel.lora import expert_targets
from jaxflow.nn.layers import Linear, RMSNorm
from jaxflow.nn.lora import LoRASpec


class Make:
    """Creates one model's Linear / RMSNorm layers with its dtypes."""

    def __init__(self, opts: ModelOptions, rngs: nnx.Rngs, eps: float = 1e-6):
        self.opts, self.rngs, self.eps = opts, rngs, eps

    def linear(self, din, dout, axes, bias=True, lora: LoRASpec | None = None):
        return Linear(din, dout, axes=axes, dtype=self.opts.compute_dtype, param_dtype=self.opts.storage_dtype,
                      rngs=self.rngs, bias=bias, lora=lora)

    def rms(self, dim, axis_name):
        return RMSNorm(dim, axis_name=axis_name, dtype=self.opts.compute_dtype, param_dtype=self.opts.storage_dtype,
                       eps=self.eps)


class Expert(nnx.Module):
    """One expert of one layer (Qwen2 decoder weights): q/k/v with biases, o and the SiLU-gated MLP without,
    input / post-attention RMSNorms, per-head q/k RMSNorms. The projections named in `adapted` carry `lora`'s
    adapter (the generation expert's LoRA targets; the understanding expert gets none)."""

    def __init__(self, cfg: BagelConfig, make: Make, lora: LoRASpec | None = None,
                 adapted: frozenset[str] = frozenset()):
        d, hd, m = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        self.head_dim = hd

        def linear(name, din, dout, axes, bias=True):
            return make.linear(din, dout, axes, bias, lora if name in adapted else None)

        self.q_proj = linear("q_proj", d, cfg.num_attention_heads * hd, ("embed", "heads"))
        self.k_proj = linear("k_proj", d, cfg.num_key_value_heads * hd, ("embed", "kv_heads"))
        self.v_proj = linear("v_proj", d, cfg.num_key_value_heads * hd, ("embed", "kv_heads"))
        self.o_proj = linear("o_proj", cfg.num_attention_heads * hd, d, ("heads", "embed"), bias=False)
        self.q_norm = make.rms(hd, "head_dim")
        self.k_norm = make.rms(hd, "head_dim")
        self.input_layernorm = make.rms(d, "embed")
        self.post_attention_layernorm = make.rms(d, "embed")
        self.gate_proj = linear("gate_proj", d, m, ("embed", "mlp"), bias=False)
        self.up_proj = linear("up_proj", d, m, ("embed", "mlp"), bias=False)
        self.down_proj = linear("down_proj", m, d, ("mlp", "embed"), bias=False)

    def qkv(self, h, lora_scale=1.0):
        """Per-head q, k (RMS-normed, before RoPE) and v of the residual stream h (B, S, d); lora_scale multiplies
        the adapters' contribution (0: the base weights, the KL reference)."""
        x = self.input_layernorm(h)
        heads = lambda y: y.reshape(*y.shape[:-1], -1, self.head_dim)  # noqa: E731
        q, k, v = (heads(p(x, lora_scale)) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.q_norm(q), self.k_norm(k), v

    def out(self, o, lora_scale=1.0):
        return self.o_proj(o, lora_scale)

    def mlp(self, h, lora_scale=1.0):
        x = self.post_attention_layernorm(h)
        gate, up = self.gate_proj(x, lora_scale), self.up_proj(x, lora_scale)
        return self.down_proj(jax.nn.silu(gate) * up, lora_scale)


def route(und_fn, gen_fn, x: jax.Array, is_gen: np.ndarray):
    """und_fn on the tokens (axis 1) where the static mask is_gen is False, gen_fn on the others, outputs (arrays or
    tuples of them) put back in token order. The mask is numpy, so each expert computes its own tokens only."""
    parts = [(fn, idx) for fn, idx in ((und_fn, np.flatnonzero(~is_gen)), (gen_fn, np.flatnonzero(is_gen)))
             if idx.size]
    if len(parts) == 1:
        return parts[0][0](x)
    outs = [fn(x[:, idx]) for fn, idx in parts]
    inverse = np.argsort(np.concatenate([idx for _, idx in parts]))
    return jax.tree.map(lambda *ys: jnp.concatenate(ys, axis=1)[:, inverse], *outs)


class MoTLayer(nnx.Module):
    """Qwen2MoTDecoderLayer: pre-norm attention and MLP residuals, each op by the token's expert. LoRA (if any)
    on the generation expert only (docs/bagel.md §5)."""

    def __init__(self, cfg: BagelConfig, make: Make, lora: LoRASpec | None = None):
        self.und = Expert(cfg, make)
        self.gen = Expert(cfg, make, lora, expert_targets(lora))

    def __call__(self, h, is_gen: np.ndarray, cos, sin, past, kv_len, causal: bool, impl: str, lora_scale=1.0):
        """h (B, S, d); cos/sin (B or 1, S or 1, head_dim/2), the tokens' RoPE; past: this layer's cached context
        (k, v), each (B, L, kv_heads, head_dim), seen after the tokens' own keys, or None; kv_len (B,) visible keys
        of [own ; past] (None = all); causal for a prefill; lora_scale scales the generation expert's adapters.
        Returns h and the tokens' (k, v) after norm and RoPE."""
        gen = lambda fn: lambda x: fn(x, lora_scale)  # noqa: E731
        q, k, v = route(self.und.qkv, gen(self.gen.qkv), h, is_gen)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        own = (k, v)
        if past is not None:
            k, v = jnp.concatenate([k, past[0]], axis=1), jnp.concatenate([v, past[1]], axis=1)
        o = attention(q, k, v, kv_len, impl, causal=causal)
        o = o.reshape(*o.shape[:2], -1)
        h = h + route(self.und.out, gen(self.gen.out), o, is_gen)
        h = h + route(self.und.mlp, gen(self.gen.mlp), h, is_gen)
        return h, own
