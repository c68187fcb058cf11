"""The attention's q/k RMSNorm and RoPE in plain torch, so torch.compile fuses them with the q/k/v split and concat.

vLLM-Omni 0.20's Qwen-Image attention (`QwenImageCrossAttention`) normalises q and k of each stream with vLLM's
`RMSNorm` (its own CUDA kernel, one small block per head row) and rotates them with vLLM's FlashAttention Triton
rotary kernel, then concatenates text and image q, k, v for the attention call. All three are opaque to inductor,
so each is a separate pass over q and k (four kernels per stream and block, then the copies of the concat); in the
recipe's rollout the norm and rotary kernels alone were 8.9% of the GPU's kernel time (BENCHMARKS.md, true CFG in
one forward or two). `use_native_qk(transformer)` swaps those modules for the ones below, which compute the same
float32 formulas in torch ops: the region vLLM-Omni compiles (each transformer block, up to the attention call)
then reads q/k/v once and writes the joint tensors once.

Numerics: the same float32 arithmetic as vLLM's kernels, except that where inductor fuses the norm into the
rotation it keeps the normed value in float32 instead of rounding it to bf16 in between (one rounding less).
"""
from __future__ import annotations

import torch

QK_OPS = ("compiled", "vllm")  # engine option `qk_ops`: these modules, or vLLM-Omni's own kernels
NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """vLLM's RMSNorm: x / sqrt(mean(x^2) + eps) in float32, rounded to x's dtype, times the weight."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else y * weight


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) by the angle whose cos/sin are cos[s, i]/sin[s, i], in float32.

    x (B, S, H, D); cos, sin (S, D/2) or (1, S, D/2), as vLLM-Omni's `RotaryEmbedding(is_neox_style=False)` takes them.
    """
    if cos.dim() == 3:
        cos, sin = cos[0], sin[0]
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, s = cos.float()[:, None, :], sin.float()[:, None, :]
    return torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).flatten(-2).to(x.dtype)


class NativeRMSNorm(torch.nn.Module):
    """`rms_norm` holding the replaced norm's own weight Parameter (same object: loading and sleep see no change)."""

    def __init__(self, weight: torch.nn.Parameter | None, eps: float):
        super().__init__()
        self.weight, self.eps = weight, float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class NativeRotary(torch.nn.Module):
    """`rope_interleaved` as a module with vLLM-Omni's `RotaryEmbedding` call."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rope_interleaved(x, cos, sin)


def use_native_qk(transformer: torch.nn.Module) -> int:
    """Swap every attention module's q/k norms and interleaved rotary for the native ones; returns how many
    attention modules changed. A module is one with all of `NORMS` and a `rope` whose `is_neox_style` is False;
    a norm must carry `variance_epsilon` (vLLM's RMSNorm) and its weight. ValueError if a module has the norms and
    rope but another layout (neox-style rotary, a norm without eps): nothing is swapped then."""
    found = [m for m in transformer.modules() if all(hasattr(m, n) for n in NORMS) and hasattr(m, "rope")]
    for m in found:
        odd = [n for n in NORMS if not hasattr(getattr(m, n), "variance_epsilon")]
        if odd or getattr(m.rope, "is_neox_style", None) is not False:
            raise ValueError(f"{type(m).__name__}: q/k norms {odd or NORMS} or its rope "
                             f"(is_neox_style={getattr(m.rope, 'is_neox_style', None)}) are not vLLM-Omni 0.20's "
                             f"layout; run the engine with qk_ops='vllm'")
    for m in found:
        for n in NORMS:
            norm = getattr(m, n)
            weight = norm.weight if getattr(norm, "has_weight", True) else None
            setattr(m, n, NativeRMSNorm(weight, norm.variance_epsilon))
        m.rope = NativeRotary()
    return len(found)
