"""One LoRA version on its way from the trainer to an engine: the one payload every transport carries and every
engine-side sink (jaxflow_bridge/sync/sinks.py) applies. Numpy only.

The adapter is carried one of two ways, fixed by the transport chosen at start (jaxflow/sync/transport.py): its
arrays (`tensors`: {PEFT key: array}; host numpy, or in the trainer's process device tensors the sink only reads),
or the manifest of a shared-memory file on the engine's host (`shared`, jaxflow_bridge/contract/lora_shm.py), whose
arrays `arrays()` maps without a copy. Where a process boundary's serializer is not pickle (vLLM-Omni's msgpack
between stages turns a dataclass into a dict and refuses bfloat16 arrays), the payload crosses as `to_wire()`'s plain
values and is rebuilt by `from_wire`.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from jaxflow_bridge.contract.lora import adapter_spec, lora_module
from jaxflow_bridge.contract.lora_shm import dtype_of, read_arrays


@dataclasses.dataclass(frozen=True)
class LoRAPayload:
    """Policy `version`'s adapter: PEFT lora_A (r, in) / lora_B (out, r) per module, unscaled, and its
    adapter_config (r, lora_alpha, use_rslora), which gives the scale."""

    version: int
    config: dict
    tensors: dict | None = None
    shared: dict | None = None

    def __post_init__(self):
        if (self.tensors is None) == (self.shared is None):
            raise ValueError("a LoRA payload carries either its tensors or a shared file's manifest")

    def to_wire(self) -> dict:
        """The payload as plain values any RPC serializer keeps (pickle, msgpack): {"version", "config", "tensors":
        {PEFT key: {"dtype": name, "shape": [...], "data": the array's bytes as a flat uint8 array}} or None,
        "shared": the manifest or None}. Host numpy arrays only."""
        tensors = None if self.tensors is None else {
            k: {"dtype": np.asarray(v).dtype.name, "shape": list(np.shape(v)),
                "data": np.ascontiguousarray(v).reshape(-1).view(np.uint8)} for k, v in self.tensors.items()}
        return {"version": int(self.version), "config": dict(self.config), "tensors": tensors,
                "shared": None if self.shared is None else dict(self.shared)}

    @classmethod
    def from_wire(cls, wire: Mapping) -> "LoRAPayload":
        """The payload `to_wire` made, after any serializer (its uint8 data as an array or bytes; views, no copy)."""
        tensors = None if wire["tensors"] is None else {
            k: np.frombuffer(t["data"], np.uint8).view(dtype_of(t["dtype"])).reshape(t["shape"])
            for k, t in wire["tensors"].items()}
        return cls(int(wire["version"]), dict(wire["config"]), tensors, wire["shared"])

    def arrays(self) -> dict:
        """{PEFT key: array} (views of the shared file for a manifest; FileNotFoundError if it is not here)."""
        return self.tensors if self.tensors is not None else read_arrays(self.shared)

    @property
    def keys(self) -> list[str]:
        return list(self.tensors) if self.tensors is not None else [k for k, _ in self.shared["entries"]]

    @property
    def modules(self) -> tuple[str, ...]:
        """The adapted modules' names (PEFT, prefix dropped), sorted."""
        return tuple(sorted({lora_module(k) for k in self.keys}))

    @property
    def scale(self) -> float:
        """What B @ A is multiplied by: alpha / r (alpha / sqrt(r) with rslora)."""
        spec = adapter_spec(self.config)
        return spec.alpha / (math.sqrt(spec.rank) if spec.rslora else spec.rank)
