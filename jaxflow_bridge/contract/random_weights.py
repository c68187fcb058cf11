"""Random base weights that the trainer (JAX) and the rollout (torch) draw identically on their own devices.

For benchmarks and smoke runs at full size without a checkpoint (`--config.model.init=random`): nothing is
written, read or sent; each side computes every diffusers tensor from (seed, key, element index) with integer
hashing, which is exact in any framework, and the startup fingerprint check proves both drew the same weights.

Spec, per diffusers key `name` with torch shape `shape`:
- 1-D tensors: ones if "norm" is in the name (RMSNorm scales), else zeros (biases).
- otherwise, for C-order element index i: x = (i * GOLDEN + key_id(seed, name)) mod 2^32, then murmur3's fmix32;
  w = float32((x >> 8) - 2^23) * scale(shape), scale = float32(1 / sqrt(prod(shape[1:])) / 2^23): uniform in
  [-1, 1) / sqrt(fan_in) like torch's default Linear init; then cast (round to nearest even) to the model dtype.
This module holds the constants and the numpy reference; `jaxflow_bridge/rollout/random_weights.py` (torch) and
`jaxflow/nn/random_init.py` (JAX) implement the same and are tested against it.
"""
from __future__ import annotations

import hashlib
import math

import numpy as np

GOLDEN = 0x9E3779B9
FMIX = (0x85EBCA6B, 0xC2B2AE35)
MASK = 0xFFFFFFFF


def key_id(seed: int, name: str) -> int:
    """The per-tensor stream offset: the first 4 bytes (little-endian) of sha256(f"{seed}:{name}")."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:4], "little")


def kind(name: str, shape) -> str:
    """"ones", "zeros" or "uniform" for this tensor."""
    if len(shape) == 1:
        return "ones" if "norm" in name else "zeros"
    return "uniform"


def scale(shape) -> np.float32:
    return np.float32(1.0 / math.sqrt(math.prod(shape[1:])) / 2 ** 23)


def numpy_weight(seed: int, name: str, shape, dtype=np.float32) -> np.ndarray:
    """The reference implementation (slow for big tensors; tests use it on small ones)."""
    k = kind(name, shape)
    if k != "uniform":
        return (np.ones if k == "ones" else np.zeros)(shape, dtype)
    x = np.arange(math.prod(shape), dtype=np.uint32) * np.uint32(GOLDEN) + np.uint32(key_id(seed, name))
    x ^= x >> np.uint32(16)
    x *= np.uint32(FMIX[0])
    x ^= x >> np.uint32(13)
    x *= np.uint32(FMIX[1])
    x ^= x >> np.uint32(16)
    w = ((x >> np.uint32(8)).astype(np.int32) - 2 ** 23).astype(np.float32) * scale(shape)
    return w.reshape(shape).astype(dtype)
