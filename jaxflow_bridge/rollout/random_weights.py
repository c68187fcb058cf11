"""Torch side of `jaxflow_bridge/contract/random_weights.py`: one named tensor by the shared random spec, drawn on its
device (no checkpoint, no host copy); each family's random model draws its parameters with it."""
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
