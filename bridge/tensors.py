"""Tensor handoff between torch and numpy, and safetensors bytes for crossing processes.

torch is imported inside the functions that need it: importing this module pulls in neither torch nor JAX,
and the rollout side never imports JAX. Memory is shared wherever the formats allow it; bf16 crosses numpy as
`ml_dtypes.bfloat16` through a 16-bit view, never upcast. Shared memory is one buffer seen twice: never write to
a tensor whose memory a live JAX array shares (JAX assumes its arrays never change).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

_BF16 = np.dtype(ml_dtypes.bfloat16)
_SAFETENSORS_DTYPES = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
    "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64,
    "F16": np.float16, "BF16": _BF16, "F32": np.float32, "F64": np.float64,
}


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

    if not a.flags.writeable or any(s < 0 for s in a.strides):
        a = a.copy()
    if a.dtype == _BF16:
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _host_array(x) -> np.ndarray:
    """A C-contiguous little-endian numpy array of `x` (numpy array or torch tensor)."""
    a = x if isinstance(x, np.ndarray) else torch_to_numpy(x)
    return np.asarray(a, dtype=a.dtype.newbyteorder("<"), order="C")


def to_safetensors_bytes(tensors: dict) -> bytes:
    """Serialize {name: numpy array or torch tensor} to safetensors bytes; bf16 is stored as BF16."""
    from safetensors import TensorSpec, serialize

    arrays = {name: _host_array(x) for name, x in tensors.items()}  # alive while serialize reads them
    specs = {name: TensorSpec(dtype=a.dtype.name, shape=a.shape, data_ptr=a.ctypes.data,
                              data_len=a.nbytes) for name, a in arrays.items()}
    return bytes(serialize(specs))


def from_safetensors_bytes(data: bytes, framework: str = "numpy") -> dict:
    """Deserialize safetensors bytes to {name: numpy array} or, with framework="torch", CPU tensors."""
    from safetensors import deserialize

    if framework not in ("numpy", "torch"):
        raise ValueError(f"framework: expected 'numpy' or 'torch', got {framework!r}")
    arrays = {}
    for name, view in deserialize(data):
        if view["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: unsupported safetensors dtype {view['dtype']}")
        dtype = _SAFETENSORS_DTYPES[view["dtype"]]
        arrays[name] = np.frombuffer(view["data"], dtype=dtype).reshape(view["shape"])
    if framework == "torch":
        return {name: numpy_to_torch(a) for name, a in arrays.items()}
    return arrays
