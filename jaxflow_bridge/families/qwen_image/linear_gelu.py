"""The rollout's MLP in-projection and its tanh GELU as one cuBLASLt GEMM (the GELU applied in the epilogue).

vLLM-Omni 0.20's Qwen-Image `FeedForward` runs `F.gelu(proj(x), approximate="tanh")`: the GEMM writes its
(tokens, 12288) output, and a separate elementwise kernel reads it back and writes the GELU's (342 ms of kernels a
16-image request at 512^2, BENCHMARKS.md). On a GPU `linear_gelu` asks cuBLASLt for the bias + tanh-GELU epilogue
(`torch._addmm_activation(..., use_gelu=True)`), which applies both to the float32 accumulator before the one bf16
store; elsewhere it computes the same formula in two ops (torch's CPU `_addmm_activation` applies the exact GELU,
not the tanh one). A torch custom op, so torch.compile calls it as it is.

`install_gelu_epilogue` routes `ColumnParallelApproxGELU.forward` (the class vLLM-Omni's FeedForward uses) to it where
the projection is a plain unquantized linear with a bias on one tensor-parallel rank, i.e. with no LoRA layer
around it (lora_apply="merged", or no adapter); anything else keeps the class's own forward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("jaxflow::linear_gelu", mutates_args=())
def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu(x @ weight.T + bias, approximate="tanh"); x (..., in), weight (out, in), bias (out,)."""
    if not x.is_cuda:
        return F.gelu(F.linear(x, weight, bias), approximate="tanh")
    flat = torch._addmm_activation(bias, x.reshape(-1, x.shape[-1]), weight.t(), use_gelu=True)
    return flat.view(*x.shape[:-1], weight.shape[0])


@linear_gelu.register_fake
def _linear_gelu_shape(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def epilogue_applies(proj) -> bool:
    """Whether `proj` is a plain unquantized linear adding its bias, on one tensor-parallel rank (vLLM's
    ColumnParallelLinear attributes; no LoRA wrapper around it)."""
    return (not hasattr(proj, "base_layer") and getattr(proj, "bias", None) is not None
            and getattr(proj, "tp_size", 1) == 1 and not getattr(proj, "skip_bias_add", False)
            and type(getattr(proj, "quant_method", None)).__name__ == "UnquantizedLinearMethod")


def install_gelu_epilogue(gelu_cls: type) -> bool:
    """Route `gelu_cls.forward` (vLLM-Omni's ColumnParallelApproxGELU: `proj`, then gelu with `approximate`) to
    `linear_gelu` where `epilogue_applies(self.proj)` and the GELU is the tanh one; False if installed already."""
    stock = gelu_cls.forward
    if getattr(stock, "gelu_epilogue", False):
        return False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self, "approximate", None) != "tanh" or not epilogue_applies(self.proj):
            return stock(self, x)
        return linear_gelu(x, self.proj.weight, self.proj.bias)

    forward.gelu_epilogue, forward.stock = True, stock
    forward.__doc__ = f"{stock.__qualname__} through jaxflow_bridge.families.qwen_image.linear_gelu where it applies."
    gelu_cls.forward = forward
    return True
