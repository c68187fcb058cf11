"""The safetensors reader/writer of both sides, numpy only: bf16 stays bf16 (ml_dtypes), reads are memory-mapped."""
from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32,
           "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class SafetensorsFile:
    """Lazy view of one .safetensors file: `keys()`, `shape(k)`, `dtype(k)`, `get(k)` (a read-only memmap view)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        self.metadata = header.pop("__metadata__", None) or {}
        unknown = sorted({info["dtype"] for info in header.values()} - set(_DTYPES))
        if unknown:
            raise ValueError(f"{self.path}: unsupported safetensors dtypes {unknown}")
        self._header = header
        self._offset = 8 + n
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r") if header else None

    def keys(self) -> list[str]:
        return list(self._header)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._header[key]["shape"])

    def dtype(self, key: str) -> np.dtype:
        return np.dtype(_DTYPES[self._header[key]["dtype"]])

    def get(self, key: str) -> np.ndarray:
        info = self._header[key]
        start, end = info["data_offsets"]
        raw = self._mm[self._offset + start:self._offset + end]
        return raw.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


def load(path: str | Path) -> dict[str, np.ndarray]:
    f = SafetensorsFile(path)
    return {k: np.array(f.get(k)) for k in f.keys()}


def save(tensors: dict[str, np.ndarray], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write tensors in key order; byte layout follows the safetensors spec (8-byte aligned header)."""
    arrays = {k: np.asarray(v, order="C") for k, v in tensors.items()}  # ascontiguousarray would make a 0-d array 1-d
    save_streamed({k: (a.dtype, a.shape) for k, a in arrays.items()}, arrays.__getitem__, path, metadata)


def save_streamed(specs: dict[str, tuple], produce: Callable[[str], np.ndarray], path: str | Path,
                  metadata: dict[str, str] | None = None) -> None:
    """`save` of tensors made one at a time: the header from `specs` (key -> (dtype, shape)), then `produce(key)`
    for each key in sorted order, checked against its spec and written before the next is asked for (a file far
    larger than memory). Written to PATH.tmp, renamed when whole; removed if anything fails on the way."""
    header, dtypes, offset = {}, {}, 0
    for key in sorted(specs):
        dtype, shape = np.dtype(specs[key][0]), [int(n) for n in specs[key][1]]
        if dtype not in _NAMES:
            raise ValueError(f"safetensors: unsupported dtype {dtype} for {key}")
        nbytes = dtype.itemsize * math.prod(shape)
        header[key] = {"dtype": _NAMES[dtype], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        dtypes[key], offset = dtype, offset + nbytes
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = Path(str(path) + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for key, dtype in dtypes.items():
                a = produce(key)
                if a.dtype != dtype or list(a.shape) != header[key]["shape"]:
                    raise ValueError(f"safetensors: {key} came as {a.dtype} {a.shape}, its header says "
                                     f"{header[key]['dtype']} {header[key]['shape']}")
                f.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
