"""How a model runs (`ModelOptions`: dtypes, remat, attention, matmul precision, LoRA GEMM), every family's."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

REMAT_POLICIES = ("none", "full", "save_attn", "save_matmuls", "save_matmuls_stats", "dots", "dots_no_batch")
ATTENTION_IMPLS = ("auto", "xla", "cudnn")
MATMUL_PRECISIONS = ("auto", "default", "high", "highest")
LORA_GEMMS = ("xla", "pallas")  # what runs; the config also takes "auto" (jaxflow/config/plan.py: lora_gemm)


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """How the model runs: dtypes, remat policy by name, attention implementation, matmul precision."""

    dtype: str = "float32"        # compute dtype
    param_dtype: str = "float32"  # storage dtype of the frozen base
    remat: str = "none"
    attention: str = "auto"       # auto = cudnn for bf16/fp16 on GPU, xla otherwise (chosen once, explicitly)
    scan_unroll: int = 1          # blocks per scan iteration (lax.scan unroll); >= num_layers: no scan, unrolled
    # XLA's precision for the model's matmuls; auto = "highest" (true fp32) for float32 compute, else "default"
    # (on GPUs fp32 "default" is TF32, which moves log-probs ~1e-5: too coarse for fp32 parity).
    matmul_precision: str = "auto"
    # "bfloat16" rounds the RoPE cos/sin tables as vLLM-Omni's transformer does (a parity diagnostic only)
    rope_table_dtype: str = "float32"
    # the blocks' adapted linears: "xla" (x W + b and the LoRA product as separate GEMMs) or "pallas" (one fused
    # Hopper kernel that adds the LoRA product and bias in the tile, forward and input gradient; bf16, one GPU)
    lora_gemm: str = "xla"

    def __post_init__(self):
        for key, allowed in (("dtype", DTYPES), ("param_dtype", DTYPES)):
            if getattr(self, key) not in allowed:
                raise ValueError(f"ModelOptions.{key}={getattr(self, key)!r}; choose one of {sorted(allowed)}")
        if self.scan_unroll < 1:
            raise ValueError(f"ModelOptions.scan_unroll={self.scan_unroll}; it must be >= 1 (blocks per scan step)")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"ModelOptions.remat={self.remat!r}; choose one of {REMAT_POLICIES}")
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"ModelOptions.attention={self.attention!r}; choose one of {ATTENTION_IMPLS}")
        if self.rope_table_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"ModelOptions.rope_table_dtype={self.rope_table_dtype!r}; choose float32 or bfloat16")
        if self.lora_gemm not in LORA_GEMMS:
            raise ValueError(f"ModelOptions.lora_gemm={self.lora_gemm!r}; choose one of {LORA_GEMMS}")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(f"ModelOptions.matmul_precision={self.matmul_precision!r}; choose one of "
                             f"{MATMUL_PRECISIONS}")

    @property
    def precision(self) -> str:
        """The matmul precision in force ('auto' resolved by compute dtype)."""
        if self.matmul_precision != "auto":
            return self.matmul_precision
        return "highest" if self.dtype == "float32" else "default"

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]

    @property
    def storage_dtype(self):
        return DTYPES[self.param_dtype]


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
