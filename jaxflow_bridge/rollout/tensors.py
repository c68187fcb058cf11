"""Tensor handoff between torch and numpy.

torch is imported inside the functions: importing this module pulls in neither torch nor JAX. Memory is shared
wherever the formats allow it; bf16 crosses numpy as `ml_dtypes.bfloat16` through a 16-bit view, never upcast.
Shared memory is one buffer seen twice: never write to a tensor whose memory a live JAX array shares (JAX assumes
its arrays never change).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

_BF16 = np.dtype(ml_dtypes.bfloat16)


def torch_to_numpy(t) -> np.ndarray:
    """torch.Tensor -> numpy (host copy only if the tensor is on an accelerator); bf16 stays bf16."""
    import torch

    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy().view(_BF16)
    return t.numpy()


def numpy_to_torch(a: np.ndarray):
    """numpy -> CPU torch.Tensor sharing memory; bf16 stays bf16.

    Read-only arrays and arrays with negative strides are copied first: torch cannot wrap the
    latter, and a writable tensor over a read-only buffer would let torch write where it must not.
    """
    import torch

    if a.size == 0:  # numpy strides an empty array 0; torch keeps them and its byte view (vLLM-Omni's serializer) fails
        return numpy_to_torch(np.zeros(1, a.dtype))[:0].reshape(a.shape)
    if not a.flags.writeable or any(s < 0 for s in a.strides):
        a = a.copy()
    if a.dtype == _BF16:
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)
