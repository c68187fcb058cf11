"""A pure-torch BAGEL generation path (float32, one sample at a time, no padding) and seeded tiny weights under the
checkpoint's names: the torch side of tests/families/bagel/test_bagel_model.py, written from docs/bagel.md §1, not from the Flax
model."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
import torch.nn.functional as F

from jaxflow.families.bagel.config import TINY, BagelConfig

# docs/bagel.md §6's second shape: 3 layers, 3 query heads on 1 KV head, head dim 8.
OTHER = dataclasses.replace(TINY, hidden_size=24, intermediate_size=40, num_hidden_layers=3, num_attention_heads=3,
                            num_key_value_heads=1)
LLM = "language_model.model."
_EXPERT = {"": "und", "_moe_gen": "gen"}


def sincos_2d(size: int, hidden: int) -> torch.Tensor:
    """(size^2, hidden): row r*size+c = [sin(c w), cos(c w), sin(r w), cos(r w)], w_k = 1e4^(-4k/hidden), float64."""
    w = 1.0 / 10000.0 ** (torch.arange(hidden // 4, dtype=torch.float64) / (hidden // 4))
    r, c = torch.div(torch.arange(size * size), size, rounding_mode="floor"), torch.arange(size * size) % size
    ac, ar = c[:, None].double() * w, r[:, None].double() * w
    return torch.cat([ac.sin(), ac.cos(), ar.sin(), ar.cos()], dim=1).float()


def weights(cfg: BagelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor the generation path reads, under BAGEL's checkpoint names, plus ignored ones (LM head, und
    final norm, a ViT stand-in); linears ~ N(0, 1/fan_in), biases ~ N(0, 0.1^2), norm weights 1 + N(0, 0.1^2)."""
    g = torch.Generator().manual_seed(seed)
    d, hd, m = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    nq, nkv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    sd = {}

    def linear(name, din, dout, bias=True):
        sd[f"{name}.weight"] = torch.randn(dout, din, generator=g) / math.sqrt(din)
        if bias:
            sd[f"{name}.bias"] = 0.1 * torch.randn(dout, generator=g)

    def norm(name, dim):
        sd[f"{name}.weight"] = 1.0 + 0.1 * torch.randn(dim, generator=g)

    sd[LLM + "embed_tokens.weight"] = torch.randn(cfg.vocab_size, d, generator=g)
    for i in range(cfg.num_hidden_layers):
        p = f"{LLM}layers.{i}."
        for s in _EXPERT:
            for name, dout, bias in (("q", nq, True), ("k", nkv, True), ("v", nkv, True)):
                linear(f"{p}self_attn.{name}_proj{s}", d, dout, bias)
            linear(f"{p}self_attn.o_proj{s}", nq, d, False)
            norm(f"{p}self_attn.q_norm{s}", hd)
            norm(f"{p}self_attn.k_norm{s}", hd)
            norm(f"{p}input_layernorm{s}", d)
            norm(f"{p}post_attention_layernorm{s}", d)
            linear(f"{p}mlp{s}.gate_proj", d, m, False)
            linear(f"{p}mlp{s}.up_proj", d, m, False)
            linear(f"{p}mlp{s}.down_proj", m, d, False)
    norm(LLM + "norm", d)
    norm(LLM + "norm_moe_gen", d)
    linear("language_model.lm_head", d, cfg.vocab_size, False)
    linear("time_embedder.mlp.0", 256, d)
    linear("time_embedder.mlp.2", d, d)
    linear("vae2llm", cfg.latent_dim, d)
    linear("llm2vae", d, cfg.latent_dim)
    sd["latent_pos_embed.pos_embed"] = sincos_2d(cfg.max_latent_size, d)
    linear("connector.fc1", 8, d)
    return sd


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, cfg):
    """Rotate-half RoPE of x (S, H, D) at integer positions pos (S,)."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _layer(sd, cfg, i, h, experts, pos, past, causal):
    """One MoT layer over tokens h (S, d), experts[j] = "" or "_moe_gen"; past = (k, v) of the context or None.
    Returns h and this layer's (k, v) of the tokens."""
    p, hd, eps = f"{LLM}layers.{i}.", cfg.head_dim, cfg.rms_norm_eps
    groups = {s: torch.tensor([j for j, e in enumerate(experts) if e == s], dtype=torch.long) for s in _EXPERT}
    groups = {s: idx for s, idx in groups.items() if len(idx)}
    lin = lambda name, x: F.linear(x, sd[f"{name}.weight"], sd.get(f"{name}.bias"))  # noqa: E731
    S = h.shape[0]
    q = torch.zeros(S, cfg.num_attention_heads, hd)
    k = torch.zeros(S, cfg.num_key_value_heads, hd)
    v = torch.zeros(S, cfg.num_key_value_heads, hd)
    for s, idx in groups.items():
        x = _rms(h[idx], sd[f"{p}input_layernorm{s}.weight"], eps)
        q[idx] = _rms(lin(f"{p}self_attn.q_proj{s}", x).view(len(idx), -1, hd), sd[f"{p}self_attn.q_norm{s}.weight"], eps)
        k[idx] = _rms(lin(f"{p}self_attn.k_proj{s}", x).view(len(idx), -1, hd), sd[f"{p}self_attn.k_norm{s}.weight"], eps)
        v[idx] = lin(f"{p}self_attn.v_proj{s}", x).view(len(idx), -1, hd)
    q, k = _rope(q, pos, cfg), _rope(k, pos, cfg)
    own = (k, v)
    if past is not None:
        k, v = torch.cat([past[0], k]), torch.cat([past[1], v])
    rep = cfg.num_attention_heads // cfg.num_key_value_heads
    kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), is_causal=causal)
    o = o.transpose(0, 1).reshape(S, -1)
    out = torch.zeros_like(h)
    for s, idx in groups.items():
        out[idx] = lin(f"{p}self_attn.o_proj{s}", o[idx])
    h = h + out
    out = torch.zeros_like(h)
    for s, idx in groups.items():
        x = _rms(h[idx], sd[f"{p}post_attention_layernorm{s}.weight"], eps)
        out[idx] = lin(f"{p}mlp{s}.down_proj", F.silu(lin(f"{p}mlp{s}.gate_proj", x)) * lin(f"{p}mlp{s}.up_proj", x))
    return h + out, own


@torch.no_grad()
def prefill(sd, cfg, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k, v) of one unpadded context: understanding expert, causal, positions 0..n-1."""
    h = sd[LLM + "embed_tokens.weight"][torch.tensor(ids, dtype=torch.long)]
    pos, kv = torch.arange(len(ids)), []
    for i in range(cfg.num_hidden_layers):
        h, own = _layer(sd, cfg, i, h, [""] * len(ids), pos, None, True)
        kv.append(own)
    return kv


@torch.no_grad()
def velocity(sd, cfg, ids: list[int], x: np.ndarray, t: float, grid_hw) -> np.ndarray:
    """One sample's velocity (S, latent_dim): [start, latents, end] at position len(ids) over the prefilled context."""
    kv = prefill(sd, cfg, ids) if ids else [None] * cfg.num_hidden_layers
    gh, gw = grid_hw
    lin = lambda name, y: F.linear(y, sd[f"{name}.weight"], sd.get(f"{name}.bias"))  # noqa: E731
    freqs = torch.exp(-math.log(10000.0) * torch.arange(128, dtype=torch.float32) / 128)
    arg = torch.tensor([t], dtype=torch.float32)[:, None] * freqs[None]
    temb = lin("time_embedder.mlp.2", F.silu(lin("time_embedder.mlp.0", torch.cat([arg.cos(), arg.sin()], -1))))
    rows, cols = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    pos_ids = (rows * cfg.max_latent_size + cols).reshape(-1)
    lat = lin("vae2llm", torch.from_numpy(x)) + temb + sd["latent_pos_embed.pos_embed"][pos_ids]
    emb = sd[LLM + "embed_tokens.weight"]
    h = torch.cat([emb[cfg.vision_start_id][None], lat, emb[cfg.vision_end_id][None]])
    experts = [""] + ["_moe_gen"] * len(lat) + [""]
    pos = torch.full((len(h),), len(ids))
    for i in range(cfg.num_hidden_layers):
        h, _ = _layer(sd, cfg, i, h, experts, pos, kv[i], False)
    return lin("llm2vae", _rms(h[1:-1], sd[LLM + "norm_moe_gen.weight"], cfg.rms_norm_eps)).numpy()
