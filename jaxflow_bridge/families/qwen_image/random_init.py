"""Torch side of `jaxflow_bridge/contract/random_weights.py`: a Qwen-Image transformer with the shared random weights, built on
its device (no checkpoint, no host copy)."""
from __future__ import annotations

import math

import torch

from jaxflow_bridge.contract.random_weights import FMIX, GOLDEN, MASK, key_id, kind, scale


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32) without int64 overflow: split c into 16-bit halves."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK


def torch_weight(seed: int, name: str, shape, dtype: torch.dtype, device) -> torch.Tensor:
    k = kind(name, shape)
    if k != "uniform":
        return (torch.ones if k == "ones" else torch.zeros)(shape, dtype=dtype, device=device)
    x = (torch.arange(math.prod(shape), dtype=torch.int64, device=device) * GOLDEN + key_id(seed, name)) & MASK
    x = _mul32(x ^ (x >> 16), FMIX[0])
    x = _mul32(x ^ (x >> 13), FMIX[1])
    x = x ^ (x >> 16)
    w = ((x >> 8) - 2 ** 23).to(torch.float32) * float(scale(shape))
    return w.reshape(shape).to(dtype)


def parameter_shapes(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(diffusers name, shape) of every parameter of `QwenImageTransformer2DModel(**config)`, without memory."""
    from diffusers import QwenImageTransformer2DModel

    with torch.device("meta"):
        model = QwenImageTransformer2DModel.from_config(config)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def random_named_weights(config: dict, seed: int, dtype: torch.dtype, device):
    """Yield (diffusers name, tensor) for every transformer parameter, drawn one at a time on `device`: for
    engines that load weights from an iterator (vLLM-Omni's `load_weights`), so 20B never sit twice in memory."""
    for name, shape in parameter_shapes(config):
        yield name, torch_weight(seed, name, shape, dtype, device)


def random_transformer(config: dict, seed: int, dtype: torch.dtype, device) -> torch.nn.Module:
    """`QwenImageTransformer2DModel(**config)` in `dtype` on `device` with the shared random weights."""
    from diffusers import QwenImageTransformer2DModel

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # allocate in the target dtype: 20B params in fp32 would not fit beside JAX
    try:
        with torch.device(device):
            model = QwenImageTransformer2DModel.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch_weight(seed, name, tuple(p.shape), p.dtype, p.device))
    return model
