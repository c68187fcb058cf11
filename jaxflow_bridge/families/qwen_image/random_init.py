"""The transformer with the shared random weights (`jaxflow_bridge/contract/random_weights.py`), each tensor drawn
on its device by `jaxflow_bridge/rollout/random_weights.py` (no checkpoint, no host copy)."""
from __future__ import annotations

import torch

from jaxflow_bridge.rollout.random_weights import torch_weight


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
