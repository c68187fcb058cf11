"""BAGEL's generation path in plain torch, float32 (docs/bagel.md §1): the CPU rollout model.

`BagelTorch.prefill(ids, mask)` runs the understanding expert causally over right-padded contexts and keeps every
layer's K/V; `BagelTorch.velocity(x, sigma, context, grid_hw)` runs the query [<|vision_start|>, latents,
<|vision_end|>] over them (markers: understanding expert, latents: generation expert, no causal mask) and returns
v = llm2vae(norm_moe_gen(h)) on the latent rows; `BagelTorch.extend(ids, context)` feeds one more understanding token
(a step of think mode's text decode, `think.py`). Modules carry the checkpoint's names
(`language_model.model.layers.{i}.self_attn.q_proj_moe_gen`, `time_embedder.mlp.0`, `vae2llm`, ...), so
`load_checkpoint` reads `ema.safetensors` tensors as they are. The RoPE and timestep tables are float64 numpy
rounded once to float32, as the trainer's (docs/numerics.md §6). Never imports JAX.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from jaxflow_bridge.families.bagel.keymap import IGNORED_PREFIXES

TIMESTEP_CHANNELS = 256  # the DiT sinusoid's width: [cos | sin] of 128 frequencies


@dataclasses.dataclass(frozen=True)
class BagelContext:
    """Prefilled contexts: per layer keys / values (B, L, kv_heads, head_dim) after k-norm and RoPE, and the
    (B, L) bool mask of valid (left-aligned) tokens. L may be 0: BAGEL's empty unconditional context."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    mask: torch.Tensor

    @property
    def lengths(self) -> torch.Tensor:
        """(B,) valid tokens per context: the RoPE position of the image query."""
        return self.mask.sum(dim=1)


def stack_contexts(contexts: Sequence[BagelContext]) -> BagelContext:
    """Contexts of one row each as one batch, right-padded to the longest (zero K/V, mask False)."""
    length = max(c.mask.shape[1] for c in contexts)

    def pad(t):
        return torch.cat([t, t.new_zeros(t.shape[0], length - t.shape[1], *t.shape[2:])], dim=1)

    layers = range(len(contexts[0].keys))
    return BagelContext(tuple(torch.cat([pad(c.keys[i]) for c in contexts]) for i in layers),
                        tuple(torch.cat([pad(c.values[i]) for c in contexts]) for i in layers),
                        torch.cat([pad(c.mask) for c in contexts]))


def timestep_freqs() -> torch.Tensor:
    """exp(-ln(1e4) i / 128), i < 128: the exponent in float32, exp in float64, rounded once to float32."""
    half = TIMESTEP_CHANNELS // 2
    exponent = np.float32(-np.log(10000.0)) * np.arange(half, dtype=np.float32) / np.float32(half)
    return torch.from_numpy(np.exp(exponent.astype(np.float64)).astype(np.float32))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (*positions.shape, head_dim/2) of the float32 angles position * theta^(-2i/head_dim), each
    evaluated in float64 and rounded once to float32."""
    exponent = np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)
    inv = np.float32(1.0) / np.power(np.float64(theta), exponent.astype(np.float64)).astype(np.float32)
    angles = (positions.cpu().numpy().astype(np.float32)[..., None] * inv).astype(np.float64)
    return (torch.from_numpy(np.cos(angles).astype(np.float32)).to(positions.device),
            torch.from_numpy(np.sin(angles).astype(np.float32)).to(positions.device))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX (rotate-half) RoPE of x (B, S, H, D); cos/sin broadcast against (B, S, 1, D/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MLP(nn.Module):
    def __init__(self, d: int, m: int):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, m, bias=False), nn.Linear(d, m, bias=False)
        self.down_proj = nn.Linear(m, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SelfAttention(nn.Module):
    """Both experts' q/k/v (biased), o, and per-head q/k norms: `q_proj` (understanding), `q_proj_moe_gen`, ..."""

    def __init__(self, d: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        for g in ("", "_moe_gen"):
            for name, out in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                setattr(self, f"{name}_proj{g}", nn.Linear(d, out * head_dim))
            setattr(self, f"o_proj{g}", nn.Linear(heads * head_dim, d, False))
            setattr(self, f"q_norm{g}", RMSNorm(head_dim, eps))
            setattr(self, f"k_norm{g}", RMSNorm(head_dim, eps))
        self.head_dim = head_dim

    def qkv(self, x, g: str):
        """Per-head q, k (normed, before RoPE), v of the already input-normed tokens x (B, S, d), expert g."""
        heads = lambda y: y.unflatten(-1, (-1, self.head_dim))  # noqa: E731
        q = getattr(self, f"q_norm{g}")(heads(getattr(self, f"q_proj{g}")(x)))
        k = getattr(self, f"k_norm{g}")(heads(getattr(self, f"k_proj{g}")(x)))
        return q, k, heads(getattr(self, f"v_proj{g}")(x))


def _route(fn, h: torch.Tensor, query: bool):
    """fn(x, g) over tokens h (B, S, ...): all understanding (a prefill), or, for a query, rows 0 and S-1 (the
    markers) understanding and rows 1..S-2 (the latents) generation, reassembled in token order. fn returns a
    tensor or a tuple of them."""
    if not query:
        return fn(h, "")
    und, gen = fn(torch.cat([h[:, :1], h[:, -1:]], dim=1), ""), fn(h[:, 1:-1], "_moe_gen")
    join = lambda u, x: torch.cat([u[:, :1], x, u[:, 1:]], dim=1)  # noqa: E731
    return tuple(map(join, und, gen)) if isinstance(und, tuple) else join(und, gen)


class DecoderLayer(nn.Module):
    """Qwen2MoTDecoderLayer: pre-norm attention and MLP residuals, every weighted op by the token's expert."""

    def __init__(self, d: int, m: int, heads: int, kv_heads: int, eps: float):
        super().__init__()
        self.self_attn = SelfAttention(d, heads, kv_heads, d // heads, eps)
        self.mlp, self.mlp_moe_gen = MLP(d, m), MLP(d, m)
        for g in ("", "_moe_gen"):
            setattr(self, f"input_layernorm{g}", RMSNorm(d, eps))
            setattr(self, f"post_attention_layernorm{g}", RMSNorm(d, eps))

    def forward(self, h, cos, sin, past, key_mask, query: bool):
        """h (B, S, d); cos/sin (B, S or 1, 1, D/2); past: this layer's context (k, v) or None (a causal prefill);
        key_mask: (B, 1, 1, L + S) bool over [context ; tokens], or None for all keys. Returns h and the tokens'
        (k, v)."""
        attn = self.self_attn
        q, k, v = _route(lambda x, g: attn.qkv(getattr(self, f"input_layernorm{g}")(x), g), h, query)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        own = (k, v)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=1), torch.cat([past[1], v], dim=1)
        rep = q.shape[2] // k.shape[2]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.repeat_interleave(rep, 2).transpose(1, 2),
                                           v.repeat_interleave(rep, 2).transpose(1, 2), attn_mask=key_mask,
                                           is_causal=past is None)
        o = o.transpose(1, 2).flatten(2)
        h = h + _route(lambda x, g: getattr(attn, f"o_proj{g}")(x), o, query)
        mlp = lambda x, g: getattr(self, f"mlp{g}")(getattr(self, f"post_attention_layernorm{g}")(x))  # noqa: E731
        return h + _route(mlp, h, query), own


class PositionTable(nn.Module):
    """`latent_pos_embed`: the frozen 2-D sin-cos table (max_latent_size^2, d), read from the checkpoint."""

    def __init__(self, rows: int, d: int):
        super().__init__()
        self.pos_embed = nn.Parameter(torch.zeros(rows, d), requires_grad=False)


class BagelTorch(nn.Module):
    """The tensors BAGEL's generation path reads, under the checkpoint's names; geometry as BagelConfig's fields
    (llm_config.json / config.json keys, jaxflow/families/bagel/config.py)."""

    def __init__(self, *, hidden_size: int, intermediate_size: int, num_hidden_layers: int, num_attention_heads: int,
                 num_key_value_heads: int, rms_norm_eps: float, rope_theta: float, vocab_size: int,
                 latent_patch_size: int, z_channels: int, max_latent_size: int, vision_start_id: int,
                 vision_end_id: int):
        super().__init__()
        d = hidden_size
        if d % num_attention_heads or num_attention_heads % num_key_value_heads or (d // num_attention_heads) % 2:
            raise ValueError(f"hidden_size {d} / num_attention_heads {num_attention_heads} / num_key_value_heads "
                             f"{num_key_value_heads}: need an even head_dim and whole GQA groups")
        self.head_dim, self.rope_theta, self.max_latent_size = d // num_attention_heads, rope_theta, max_latent_size
        self.latent_dim = latent_patch_size**2 * z_channels
        self.markers = (vision_start_id, vision_end_id)
        self.language_model = nn.Module()
        llm = self.language_model.model = nn.Module()
        llm.embed_tokens = nn.Embedding(vocab_size, d)
        llm.layers = nn.ModuleList(DecoderLayer(d, intermediate_size, num_attention_heads, num_key_value_heads,
                                                rms_norm_eps) for _ in range(num_hidden_layers))
        llm.norm_moe_gen = RMSNorm(d, rms_norm_eps)
        self.time_embedder = nn.Module()
        self.time_embedder.mlp = nn.Sequential(nn.Linear(TIMESTEP_CHANNELS, d), nn.SiLU(), nn.Linear(d, d))
        self.vae2llm, self.llm2vae = nn.Linear(self.latent_dim, d), nn.Linear(d, self.latent_dim)
        self.latent_pos_embed = PositionTable(max_latent_size**2, d)
        self.register_buffer("timestep_freqs", timestep_freqs(), persistent=False)

    def load_checkpoint(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy checkpoint tensors in (IGNORED_PREFIXES dropped: LM head, ViT, ...); ValueError naming any missing
        or unexpected name, or a tensor of the wrong shape."""
        used = {k: v for k, v in tensors.items() if not k.startswith(IGNORED_PREFIXES)}
        own = self.state_dict()
        missing, extra = sorted(set(own) - set(used)), sorted(set(used) - set(own))
        shapes = [f"{k}: {tuple(used[k].shape)} != {tuple(v.shape)}" for k, v in own.items()
                  if k in used and tuple(used[k].shape) != tuple(v.shape)]
        if missing or extra or shapes:
            raise ValueError(f"checkpoint tensors do not fit BagelTorch: missing {missing}, unexpected {extra}, "
                             f"shapes {shapes}")
        self.load_state_dict({k: v.to(torch.float32) for k, v in used.items()})

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> BagelContext:
        """Contexts (B, L) int ids, right-padded, and their (B, L) bool mask -> every layer's K/V; token j at RoPE
        position j, causal, understanding expert. Padding needs no mask here: valid tokens only see earlier ones."""
        if ids.dim() != 2 or mask.shape != ids.shape or mask.dtype != torch.bool:
            raise ValueError(f"prefill needs (B, L) ids and a (B, L) bool mask, got {tuple(ids.shape)} and "
                             f"{tuple(mask.shape)} {mask.dtype}")
        if (mask[:, 1:] & ~mask[:, :-1]).any():
            raise ValueError("prefill: the context mask must be left-aligned (right padding only)")
        llm = self.language_model.model
        batch, length = ids.shape
        if length == 0:
            empty = ids.new_zeros((batch, 0, llm.layers[0].self_attn.k_proj.out_features // self.head_dim,
                                   self.head_dim), dtype=torch.float32)
            return BagelContext((empty,) * len(llm.layers), (empty,) * len(llm.layers), mask)
        h = llm.embed_tokens(ids.long())
        cos, sin = rope_cos_sin(torch.arange(length, device=ids.device), self.head_dim, self.rope_theta)
        cos, sin = cos[None, :, None], sin[None, :, None]
        keys, values = [], []
        for layer in llm.layers:
            h, (k, v) = layer(h, cos, sin, None, None, query=False)
            keys.append(k)
            values.append(v)
        return BagelContext(tuple(keys), tuple(values), mask)

    @torch.inference_mode()
    def extend(self, ids: torch.Tensor, context: BagelContext) -> tuple[torch.Tensor, BagelContext]:
        """One more understanding-expert token per row, ids (B,), appended to unpadded contexts at RoPE position
        context.lengths (a step of a causal text decode): its last hidden state (B, d), before the final norm, and
        the context with its K/V."""
        if ids.shape != context.mask.shape[:1] or not context.mask.all():
            raise ValueError(f"extend needs one id per context and unpadded contexts, got ids {tuple(ids.shape)} "
                             f"for contexts {tuple(context.mask.shape)} ({int(context.mask.sum())} valid)")
        h = self.language_model.model.embed_tokens(ids.long())[:, None]
        cos, sin = rope_cos_sin(context.lengths, self.head_dim, self.rope_theta)
        keys, values = [], []
        for layer, k, v in zip(self.language_model.model.layers, context.keys, context.values):
            h, (k_new, v_new) = layer(h, cos[:, None, None], sin[:, None, None], (k, v), None, query=False)
            keys.append(torch.cat([k, k_new], dim=1))
            values.append(torch.cat([v, v_new], dim=1))
        mask = torch.cat([context.mask, context.mask.new_ones(len(ids), 1)], dim=1)
        return h[:, 0], BagelContext(tuple(keys), tuple(values), mask)

    @torch.inference_mode()
    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, context: BagelContext,
                 grid_hw: tuple[int, int]) -> torch.Tensor:
        """float32 velocity (B, S, latent_dim) of latents x (B, S, latent_dim) at sigma (B,), tokens row-major on
        the grid_hw = (h, w) latent grid, over `context` (B rows). Every query token sits at RoPE position
        context.lengths and sees its valid context and the whole query."""
        gh, gw = grid_hw
        batch = x.shape[0]
        if x.dim() != 3 or x.shape[1:] != (gh * gw, self.latent_dim):
            raise ValueError(f"latents {tuple(x.shape)} must be (B, h*w = {gh * gw}, {self.latent_dim}) for "
                             f"grid_hw {grid_hw}")
        if max(gh, gw) > self.max_latent_size or sigma.shape != (batch,) or context.mask.shape[0] != batch:
            raise ValueError(f"grid_hw {grid_hw} (at most {self.max_latent_size} a side), sigma "
                             f"{tuple(sigma.shape)} and {context.mask.shape[0]} contexts must fit {batch} samples")
        llm = self.language_model.model
        arg = sigma.float()[:, None] * self.timestep_freqs[None]
        temb = self.time_embedder.mlp(torch.cat([arg.cos(), arg.sin()], dim=-1))
        rows = torch.arange(gh, device=x.device)[:, None] * self.max_latent_size
        pos = self.latent_pos_embed.pos_embed[(rows + torch.arange(gw, device=x.device)).reshape(-1)]
        lat = self.vae2llm(x.float()) + temb[:, None] + pos[None]
        start, end = llm.embed_tokens(torch.tensor(self.markers, device=x.device))
        h = torch.cat([start.expand(batch, 1, -1), lat, end.expand(batch, 1, -1)], dim=1)
        cos, sin = rope_cos_sin(context.lengths, self.head_dim, self.rope_theta)
        cos, sin = cos[:, None, None], sin[:, None, None]
        key_mask = None
        if not context.mask.all():
            key_mask = torch.cat([context.mask, context.mask.new_ones(batch, h.shape[1])], dim=1)[:, None, None]
        for layer, k, v in zip(llm.layers, context.keys, context.values):
            h, _ = layer(h, cos, sin, (k, v), key_mask, query=True)
        return self.llm2vae(llm.norm_moe_gen(h[:, 1:-1]))
