"""The rollout's base-weight fingerprint, every engine's and family's: sha256 over each tensor's name, shape and
first elements (the trainer computes the same from its Flax weights: `jaxflow/nn/weights.py`)."""
from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch

FINGERPRINT_ELEMENTS = 4096


class TensorHead:
    """What `weights_fingerprint` reads of a tensor: its shape and its first elements (the rest need not exist)."""

    def __init__(self, shape, head):
        self.shape, self.head = tuple(shape), head

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorHead:
        return cls(t.shape, t.detach().reshape(-1)[:FINGERPRINT_ELEMENTS].to("cpu"))

    def detach(self):
        return self

    def reshape(self, *shape):
        return self.head.reshape(*shape)


def weights_fingerprint(named_tensors) -> str:
    """sha256 of the base weights: per tensor in name order, f"{name}{shape}" then the bf16 bytes of its first
    4096 elements (C order). Cheap for 20B, yet every tensor counts; bf16 rounding makes fp32 and bf16 copies of
    one checkpoint agree. Trainer mirror: `np.asarray(x.reshape(-1)[:4096], ml_dtypes.bfloat16).tobytes()`.
    """
    h = hashlib.sha256()
    for name, t in sorted(named_tensors, key=lambda kv: kv[0]):
        head = t.detach().reshape(-1)[:FINGERPRINT_ELEMENTS].to("cpu", torch.bfloat16)
        h.update(f"{name}{tuple(t.shape)}".encode())
        h.update(head.view(torch.uint16).numpy().tobytes())
    return h.hexdigest()


def stored_fingerprint(folder, pattern: str = "*.safetensors", skip: tuple[str, ...] = ()) -> str:
    """`weights_fingerprint` of the tensors in `folder`'s safetensors files matching `pattern`, names starting with
    one of `skip` left out, reading only the first 4096 elements of each: what an engine loading those tensors
    reports (each family's `spec.fingerprint_files` names the files and the names left out)."""
    from safetensors import safe_open

    heads = []
    for path in sorted(Path(folder).glob(pattern)):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                if key.startswith(skip):
                    continue
                stored = f.get_slice(key)
                shape = stored.get_shape()
                rows = -(-FINGERPRINT_ELEMENTS // max(1, math.prod(shape[1:])))
                heads.append((key, TensorHead(shape, stored[:rows])))
    if not heads:
        raise FileNotFoundError(f"no {pattern} in {folder}")
    return weights_fingerprint(heads)
