"""Building blocks: LoRA-capable Linear, RMSNorm, LayerNorm, GELU-tanh (diffusers numerics)."""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxflow.nn.lora import LoRAParam, LoRASpec
from jaxflow.nn.lora_gemm import lora_linear

Axes = tuple[str | None, ...]


def _normal(rngs: nnx.Rngs, shape, dtype, std: float) -> jax.Array:
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype)


class Linear(nnx.Module):
    """y = x W + b (+ scale * (x A) B when a LoRA adapter is attached). Kernel layout (in, out); bias=False: no b."""

    def __init__(self, din: int, dout: int, *, axes: Axes, dtype, param_dtype, rngs: nnx.Rngs,
                 lora: LoRASpec | None = None, bias: bool = True):
        self.dtype = dtype
        self.kernel = nnx.Param(_normal(rngs, (din, dout), param_dtype, din ** -0.5), logical_axes=axes)
        self.bias = nnx.Param(jnp.zeros((dout,), param_dtype), logical_axes=(axes[1],)) if bias else None
        self.lora_scaling = None
        if lora is not None:
            self.lora_scaling = lora.alpha / lora.rank
            # PEFT "gaussian" init: A ~ N(0, (1/r)^2), B = 0.
            self.lora_a = LoRAParam(_normal(rngs, (din, lora.rank), jnp.float32, 1.0 / lora.rank),
                                    logical_axes=(axes[0], None))
            self.lora_b = LoRAParam(jnp.zeros((lora.rank, dout), jnp.float32), logical_axes=(None, axes[1]))

    def __call__(self, x: jax.Array, lora_scale: jax.Array | float = 1.0, gemm: str | Callable = "xla") -> jax.Array:
        """gemm="pallas" (ModelOptions.lora_gemm): an adapted layer runs as one fused kernel (jaxflow/nn/lora_gemm.py),
        every term in the compute dtype, rounded once; a callable: that fused matmul instead (the kernel with its
        rows split over devices, `lora_gemm.split_rows`); layers without an adapter are XLA's GEMM either way."""
        x = x.astype(self.dtype)
        w = self.kernel.astype(self.dtype)
        bias = None if self.bias is None else self.bias.astype(self.dtype)

        def base():
            return x @ w if bias is None else x @ w + bias

        if self.lora_scaling is None:
            return base()
        # The scale multiplies B (rank x out), not the (tokens x out) product as PEFT does: no full-size
        # multiply forward or backward. Bit-identical to PEFT in any dtype when the scale is a power of two
        # (alpha / rank = 2 in every recipe) or 0; otherwise one rounding fewer.
        b = (self.lora_b[...] * (self.lora_scaling * lora_scale)).astype(self.dtype)
        a = self.lora_a.astype(self.dtype)
        if gemm != "xla":
            bias = jnp.zeros((w.shape[1],), self.dtype) if bias is None else bias
            rows = x.reshape(-1, x.shape[-1])
            out = lora_linear(rows, w, bias, a, b) if gemm == "pallas" else lora_linear(rows, w, bias, a, b, gemm)
            return out.reshape(*x.shape[:-1], out.shape[-1])
        return base() + (x @ a) @ b


class RMSNorm(nnx.Module):
    """diffusers RMSNorm: statistics in fp32, result cast to the compute dtype before the weight."""

    def __init__(self, dim: int, *, axis_name: str | None, dtype, param_dtype, eps: float = 1e-6):
        self.dtype, self.eps = dtype, eps
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=(axis_name,))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return y.astype(self.dtype) * self.scale.astype(self.dtype)


def layer_norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """LayerNorm without affine params, accumulated in fp32, returned in the input dtype."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)


def gelu_tanh(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x.astype(jnp.float32), approximate=True).astype(x.dtype)
