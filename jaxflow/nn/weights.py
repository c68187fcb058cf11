"""A checkpoint's tensors as the trainer reads them, shared by the families' loaders: `TensorSource` (a safetensors
file, a sharded diffusers-style folder or a dict), the variable at a key-map entry's Flax path, and the base-weight
fingerprint over a key map (the rollout's `weights_fingerprint` of the same checkpoint names)."""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Callable

import jax
import numpy as np
from flax import nnx

from jaxflow_bridge.contract import safetensors_io
from jaxflow_bridge.contract.weight_keys import Entry

WEIGHTS = "diffusion_pytorch_model.safetensors"

INDEX = WEIGHTS + ".index.json"

# (flax path, logical axes, shape) -> Sharding or None (= default device)
ShardingFn = Callable[[tuple[str, ...], tuple, tuple[int, ...]], "jax.sharding.Sharding | None"]


class TensorSource:
    """Key -> lazily read tensor over one safetensors file, a sharded folder (index.json), or a dict."""

    def __init__(self, tensors: dict[str, np.ndarray] | None = None, files: dict[str, Path] | None = None):
        self._tensors = tensors or {}
        self._open: dict[Path, safetensors_io.SafetensorsFile] = {}
        self._files = files or {}

    @classmethod
    def from_folder(cls, folder: str | Path) -> "TensorSource":
        folder = Path(folder)
        if (folder / INDEX).exists():
            weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
            return cls(files={k: folder / f for k, f in weight_map.items()})
        if not (folder / WEIGHTS).exists():
            raise FileNotFoundError(f"{folder} has neither {WEIGHTS} nor {INDEX}")
        return cls.from_file(folder / WEIGHTS)

    @classmethod
    def from_file(cls, path: str | Path) -> "TensorSource":
        """Every tensor of one safetensors file."""
        f = safetensors_io.SafetensorsFile(path)
        src = cls(files={k: f.path for k in f.keys()})
        src._open[f.path] = f
        return src

    def keys(self) -> set[str]:
        return set(self._tensors) | set(self._files)

    def _file(self, key):
        path = self._files[key]
        if path not in self._open:
            self._open[path] = safetensors_io.SafetensorsFile(path)
        return self._open[path]

    def shape(self, key) -> tuple[int, ...]:
        return tuple(self._tensors[key].shape) if key in self._tensors else self._file(key).shape(key)

    def get(self, key) -> np.ndarray:
        return np.asarray(self._tensors[key]) if key in self._tensors else self._file(key).get(key)


def report(problems: list[str], what: str) -> None:
    if problems:
        raise ValueError(f"{what}: {len(problems)} problem(s); first {min(20, len(problems))}: {problems[:20]}")


def state_leaf(state: nnx.State, path):
    """The variable at `path` (a keymap Entry's flax_path) of an nnx state."""
    node = state
    for p in path:
        node = node[p]
    return node

FINGERPRINT_ELEMENTS = 4096


def entries_fingerprint(base: nnx.State, entries: list[Entry], num_layers: int) -> str:
    """sha256 of the weights `entries` map, as the rollout's `weights_fingerprint` hashes the torch tensors of their
    checkpoint names: per name in sorted order, f"{name}{torch shape}" then the bf16 bytes of its first 4096
    elements in torch layout. Reads only those elements from the device, all of them in one program (`_heads`: one
    compile and one transfer, where slicing each tensor eagerly compiled a program per shape)."""
    import hashlib

    import ml_dtypes

    values = {e.flax_path: state_leaf(base, e.flax_path).get_value() for e in entries}
    plan = {e.flax_path: (e.stacked, e.transpose, e.diffusers_keys(num_layers)) for e in entries}
    heads = jax.device_get(_heads(values, plan))
    h = hashlib.sha256()
    for key in sorted(heads):
        shape, head = heads[key]
        h.update(f"{key}{shape}".encode())
        h.update(np.asarray(np.ravel(head), ml_dtypes.bfloat16).tobytes())
    return h.hexdigest()


def _heads(values: dict, plan: dict) -> dict:
    """{checkpoint name: (torch shape, its first FINGERPRINT_ELEMENTS elements in torch layout)} of `values`
    ({flax path: an array, a (layers, ...) stack or one array per block}), each path's (stacked, transpose, names)
    in `plan`: the slices of every tensor in one jit."""
    shapes, layout = {}, {}
    for path, (stacked, transpose, keys) in plan.items():
        value = values[path]
        for i, key in enumerate(keys):
            shape = tuple((value[i].shape if isinstance(value, tuple) else value.shape[1:]) if stacked else value.shape)
            layout[key] = (path, i if stacked else None, transpose)
            shapes[key] = shape[::-1] if transpose else shape
    heads = _heads_jit(values, tuple(sorted(layout.items())))
    return {key: (shapes[key], heads[key]) for key in shapes}


@functools.partial(jax.jit, static_argnums=1)
def _heads_jit(values: dict, layout: tuple) -> dict:
    """{name: its head} for `layout`'s (name, (path, layer or None, transpose)), read from `values`."""
    out = {}
    for key, (path, layer, transpose) in layout:
        t = values[path] if layer is None else values[path][layer]
        if transpose:  # torch (out, in): its first elements are the first columns of the (in, out) kernel
            t = t[:, :-(-FINGERPRINT_ELEMENTS // t.shape[0])].T
        out[key] = t.reshape(-1)[:FINGERPRINT_ELEMENTS]
    return out
