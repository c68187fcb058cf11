"""LoRA: its own NNX variable type, the adapter spec, merge, and the Flax state <-> PEFT arrays conversion (PEFT
folders are written and read by `jaxflow_bridge.contract.lora`)."""
from __future__ import annotations

import abc
import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxflow_bridge.contract import lora as peft_folder
from jaxflow_bridge.contract.weight_keys import Entry


class LoRAParam(nnx.Variable):
    """Trainable low-rank adapter weights; deliberately not an nnx.Param so base filters never include them."""


@dataclasses.dataclass(frozen=True)
class LoRASpec(abc.ABC):
    """rank r, alpha (scaling alpha/r) and target module names. Each family's subclass names its targets and PEFT
    keys (its key map), so the PEFT conversions below serve any family."""

    rank: int = 64
    alpha: float = 128.0
    targets: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not self.targets:
            raise ValueError("LoRA targets is empty; use e.g. keymap.DEFAULT_LORA_TARGETS")
        for t in self.targets:
            self.target_path(t)

    @abc.abstractmethod
    def target_path(self, target: str) -> tuple[str, ...]:
        """The Flax module path of target `target`; ValueError naming the known targets."""

    @abc.abstractmethod
    def key_map(self) -> list[Entry]:
        """The adapters' leaves and their PEFT keys."""

    def target_paths(self) -> set[tuple[str, ...]]:
        return {self.target_path(t) for t in self.targets}

    def peft_config(self) -> dict:
        """adapter_config.json content PEFT and diffusers' load_lora_weights understand."""
        return peft_folder.adapter_config(self.rank, self.alpha, self.targets)


def _get(state: nnx.State, path):
    node = state
    for p in path:
        node = node[p]
    return node


@functools.partial(jax.jit, static_argnums=1)
def _torch_layout(stacked: jax.Array, dtype) -> jax.Array:
    return stacked.swapaxes(-1, -2).astype(stacked.dtype if dtype is None else dtype)


def peft_stacks(model: nnx.Module | nnx.State, spec: LoRASpec, dtype=None) -> list[tuple[list[str], jax.Array]]:
    """Per LoRA weight (target x A/B): its layers' PEFT keys and their stacked (L, out, in) weights in torch's
    layout, transposed (and cast to `dtype`, default: kept) on the device in one jit; fresh buffers, never the
    state's own (the next train step donates those). A host (numpy) state gives numpy views."""
    state = model if isinstance(model, nnx.State) else nnx.state(model, LoRAParam)
    dtype = None if dtype is None else jnp.dtype(dtype)
    out = []
    for e in spec.key_map():
        x = _get(state, e.flax_path)[...]
        if isinstance(x, jax.Array):
            stacked = _torch_layout(x, dtype)
        else:
            stacked = np.swapaxes(x, -1, -2).astype(x.dtype if dtype is None else dtype, copy=False)
        out.append((e.diffusers_keys(stacked.shape[0]), stacked))
    return out


def lora_to_peft(model: nnx.Module | nnx.State, spec: LoRASpec) -> dict[str, np.ndarray]:
    """PEFT state dict (`transformer_blocks.N.<target>.lora_A.weight` ...) as host arrays from a model's LoRA
    params or from its LoRA state (e.g. the train state's)."""
    out = {}
    # transposed on the device before the host copy (numpy's per-layer transposes were most of the sync time at
    # full size), so every layer below is a contiguous view
    for keys, stacked in peft_stacks(model, spec):
        stacked = np.asarray(stacked)
        out.update((key, np.ascontiguousarray(stacked[i])) for i, key in enumerate(keys))
    return out


@functools.lru_cache(maxsize=8)
def _peft_layout(spec: LoRASpec, layers: tuple[int, ...]) -> dict[str, tuple[int, int, int, int]]:
    """{PEFT module: (A's key-map entry, its layer, B's entry, its layer)} of `spec`'s stacks of `layers` layers
    (one count per key-map entry), sorted by module."""
    found: dict[str, dict[str, tuple[int, int]]] = {}
    for n, (e, count) in enumerate(zip(spec.key_map(), layers)):
        for i, key in enumerate(e.diffusers_keys(count)):
            match = peft_folder.LORA_KEY.fullmatch(key)
            found.setdefault(match["module"], {})[match["part"]] = (n, i)
    return {m: found[m]["A"] + found[m]["B"] for m in sorted(found)}


def _stacks(model: nnx.Module | nnx.State, spec: LoRASpec) -> tuple[list, dict[str, tuple[int, int, int, int]]]:
    """The LoRA state's stacked arrays in key-map order and their `_peft_layout`."""
    state = model if isinstance(model, nnx.State) else nnx.state(model, LoRAParam)
    stacks = [_get(state, e.flax_path)[...] for e in spec.key_map()]
    return stacks, _peft_layout(spec, tuple(int(x.shape[0]) for x in stacks))


@jax.jit
def _probe_gather(a_stacks, b_stacks, index, rows, cols):
    """A[:, cols] (m, r, k) and B[rows] (m, k, r) in float32 of m modules: module n's A is layer index[n, 1] of
    a_stacks[index[n, 0]] (flax layout (L, in, r)), its B layer index[n, 3] of b_stacks[index[n, 2]] ((L, r, out));
    rows, cols (m, k). Each stack is gathered for every module and the owner's values kept, so one program serves
    any choice of modules (the indices are arguments: one compile per shape, not per version)."""
    def pick(stacks, owner, layer, take):
        out = None
        for s, x in enumerate(stacks):  # an index past a stack's size is clamped; the owner test drops it
            got = take(x, layer[:, None]).astype(jnp.float32)  # (m, k, r)
            out = got if out is None else jnp.where((owner == s)[:, None, None], got, out)
        return out
    a = pick(a_stacks, index[:, 0], index[:, 1], lambda x, layer: x[layer, cols])
    b = pick(b_stacks, index[:, 2], index[:, 3], lambda x, layer: x[layer, :, rows])
    return a.swapaxes(1, 2), b


def peft_probe(model: nnx.Module | nnx.State, spec: LoRASpec, positions) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{PEFT module: (lora_A[:, cols] (r, k), lora_B[rows] (k, r))} host float32 arrays at `positions(module, (out,
    in))` -> (rows, cols), each (k,) with one k for all, of each module it returns a value for (None: not read): only
    those rows and columns are gathered on the device, in one program, and come to the host in one copy."""
    stacks, layout = _stacks(model, spec)
    a_of = {n: s for s, n in enumerate(sorted({v[0] for v in layout.values()}))}  # entry -> its place among A's
    b_of = {n: s for s, n in enumerate(sorted({v[2] for v in layout.values()}))}
    picked, index, rows, cols = [], [], [], []
    for module, (na, i, nb, j) in layout.items():
        at = positions(module, (stacks[nb].shape[2], stacks[na].shape[1]))
        if at is not None:
            picked.append(module)
            index.append((a_of[na], i, b_of[nb], j))
            rows.append(at[0])
            cols.append(at[1])
    if not picked:
        return {}
    a_stacks, b_stacks = [stacks[n] for n in a_of], [stacks[n] for n in b_of]
    if all(isinstance(x, jax.Array) for x in stacks):
        a, b = jax.device_get(_probe_gather(a_stacks, b_stacks, np.asarray(index, np.int32),
                                            np.asarray(rows, np.int32), np.asarray(cols, np.int32)))
    else:  # a host state
        a = [a_stacks[s][i][c].T for (s, i, _, _), c in zip(index, cols)]
        b = [b_stacks[s][j][:, r].T for (_, _, s, j), r in zip(index, rows)]
    return {m: (np.asarray(a[n], np.float32), np.asarray(b[n], np.float32)) for n, m in enumerate(picked)}


def peft_modules(model: nnx.Module | nnx.State, spec: LoRASpec) -> list[str]:
    """The adapted modules' PEFT names (prefix dropped), sorted: from the stacks' shapes, no array read."""
    return list(_stacks(model, spec)[1])


def peft_to_lora(model: nnx.Module, spec: LoRASpec, tensors: dict[str, np.ndarray]) -> None:
    """Set the model's LoRA params from a PEFT state dict; all keys and shapes are checked before any write."""
    tensors = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    state = nnx.state(model, LoRAParam)
    new, problems, expected = {}, [], set()
    for e in spec.key_map():
        var = _get(state, e.flax_path)
        num_layers = var.shape[0]
        keys = e.diffusers_keys(num_layers)
        expected.update(keys)
        layers = []
        for key in keys:
            want = var.shape[1:][::-1]
            if key not in tensors:
                problems.append(f"missing {key}")
            elif tuple(tensors[key].shape) != want:
                problems.append(f"shape {key}: got {tuple(tensors[key].shape)}, expected {want}")
            else:
                layers.append(np.asarray(tensors[key], np.float32).T)
        if len(layers) == num_layers:
            new[e.flax_path] = np.stack(layers)
    problems += [f"unexpected {k}" for k in sorted(set(tensors) - expected)]
    if problems:
        raise ValueError(f"LoRA state dict does not match the model ({len(problems)} problems): {problems[:20]}")
    for path, value in new.items():
        var = _get(state, path)
        var[...] = jnp.asarray(value, var.dtype)
    nnx.update(model, state)


def save_peft(model: nnx.Module | nnx.State, spec: LoRASpec, directory: str | Path) -> Path:
    """Write a model's LoRA (or its LoRA state) as a PEFT folder that diffusers' `load_lora_weights` loads as is
    (`jaxflow_bridge.contract.lora.write_peft`); an adapter already in `directory` is replaced."""
    return peft_folder.write_peft(directory, lora_to_peft(model, spec), spec.peft_config(), diffusers=True,
                                  replace=True)


def merged_kernels(model: nnx.Module) -> dict[tuple[str, ...], np.ndarray]:
    """Base kernels with the adapters folded in (W + alpha/r * A B), keyed by Flax kernel path; for export."""
    out = {}
    for path, node in nnx.iter_graph(model):
        if getattr(node, "lora_scaling", None) is None or not hasattr(node, "kernel"):
            continue
        a, b = np.asarray(node.lora_a[...], np.float32), np.asarray(node.lora_b[...], np.float32)
        kernel = np.asarray(node.kernel.get_value())  # a stack, or one array per block (unstack_blocks)
        delta = np.matmul(a, b) * node.lora_scaling
        out[tuple(str(p) for p in path) + ("kernel",)] = (kernel.astype(np.float32) + delta).astype(kernel.dtype)
    return out
