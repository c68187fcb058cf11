"""A LoRA adapter in one shared-memory file: the trainer writes it every step, an engine on the same host reads it
in place (docs/design.md, "LoRA sync"). Numpy only.

File: a 16-byte token, then the adapter's tensors back to back in `dtype`, in the order of the manifest's entries
(PEFT keys and shapes; lora_B as PEFT stores it, alpha/r applied by the engine). The manifest (plain Python, what
crosses Ray) carries the path, the token, the dtype and the entries; a reader on another host, or after the file
was replaced, finds no file or another token and raises FileNotFoundError, so the sender can fall back to sending
the arrays themselves.
"""
from __future__ import annotations

import math
import tempfile
import uuid
from pathlib import Path

import ml_dtypes
import numpy as np

TOKEN_BYTES = 16
SHM_ROOT = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def dtype_of(name: str) -> np.dtype:
    """The numpy dtype of a manifest's dtype name (bfloat16 through ml_dtypes)."""
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def offsets(entries) -> list[int]:
    """Element offset of each (key, shape) entry in the payload, and the total as the last item."""
    out = [0]
    for _, shape in entries:
        out.append(out[-1] + math.prod(shape))
    return out


class SharedAdapterFile:
    """The writer's side: one file under /dev/shm, reused every step (its pages stay allocated), removed by
    `close`. `write(flat, entries)` takes the whole payload as one flat array in the manifest's dtype."""

    def __init__(self, dtype: str = "bfloat16", root: Path = SHM_ROOT):
        self.dtype, self.token = dtype, uuid.uuid4().bytes
        self.path = Path(root) / f"jaxflow-lora-{uuid.uuid4().hex}.bin"
        self._map = None

    def write(self, flat: np.ndarray, entries: list) -> dict:
        """Write `flat` (1-D, `dtype`, the entries' tensors back to back) and return the manifest."""
        flat = np.asarray(flat)
        if flat.dtype != dtype_of(self.dtype):
            raise ValueError(f"shared LoRA payload: expected dtype {self.dtype}, got {flat.dtype}")
        self.payload(entries)[:] = flat
        return self.seal(entries)

    def write_arrays(self, tensors: dict[str, np.ndarray]) -> dict:
        """Write PEFT arrays (any float dtype, cast to the file's) lora_A first, as the trainer lays the file out;
        the manifest."""
        keys = sorted(tensors, key=lambda k: ("lora_B" in k, k))
        flat = np.concatenate([np.zeros(0, dtype_of(self.dtype))] +
                              [np.asarray(tensors[k]).astype(dtype_of(self.dtype)).reshape(-1) for k in keys])
        return self.write(flat, [(k, np.shape(tensors[k])) for k in keys])

    def payload(self, entries: list) -> np.ndarray:
        """The file's payload for `entries` as a writable flat array (the file made or resized first)."""
        total = offsets(entries)[-1]
        size = TOKEN_BYTES + total * dtype_of(self.dtype).itemsize
        if self._map is None or self._map.size != size:
            with open(self.path, "wb") as f:
                f.truncate(size)
            self._map = np.memmap(self.path, np.uint8, mode="r+", shape=(size,))
        return self._map[TOKEN_BYTES:].view(dtype_of(self.dtype))

    def seal(self, entries: list) -> dict:
        """Stamp the token once the payload is written; the manifest to send."""
        self._map[:TOKEN_BYTES] = np.frombuffer(self.token, np.uint8)
        return {"path": str(self.path), "token": self.token.hex(), "dtype": self.dtype,
                "entries": [[k, list(s)] for k, s in entries]}

    def close(self) -> None:
        self._map = None
        self.path.unlink(missing_ok=True)


def open_payload(manifest: dict) -> np.ndarray:
    """The payload of a manifest's file as a read-only flat array (a view of the mapped file); FileNotFoundError if
    the file is absent or holds another token (another host's, or a replaced file)."""
    path = Path(manifest["path"])
    if not path.is_file():
        raise FileNotFoundError(f"shared LoRA file {path} is not on this host")
    data = np.memmap(path, np.uint8, mode="r")
    if bytes(data[:TOKEN_BYTES]) != bytes.fromhex(manifest["token"]):
        raise FileNotFoundError(f"shared LoRA file {path} holds another adapter's token")
    total = offsets(manifest["entries"])[-1]
    dtype = dtype_of(manifest["dtype"])
    if data.size != TOKEN_BYTES + total * dtype.itemsize:
        raise ValueError(f"shared LoRA file {path}: {data.size} bytes, the manifest needs "
                         f"{TOKEN_BYTES + total * dtype.itemsize}")
    return data[TOKEN_BYTES:].view(dtype)


def read_arrays(manifest: dict) -> dict[str, np.ndarray]:
    """{PEFT key: array view} of a manifest's file (see `open_payload`)."""
    flat, entries = open_payload(manifest), manifest["entries"]
    starts = offsets(entries)
    return {k: flat[starts[i]:starts[i + 1]].reshape(s) for i, (k, s) in enumerate(entries)}
