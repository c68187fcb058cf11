"""The engine side of LoRA sync for a torch transformer (the diffusers engine's): one sink per apply mode, each
taking the one payload (`contract.lora_payload.LoRAPayload`) and leaving the same served weights, W + scale * B @ A.

- "layers" (`LayersSink`): PEFT LoRA layers bound to the adapted Linear layers (`sync/layers.py`), the default;
- "merged" (`MergedSink`): the adapter merged into the base weights from the payload's arrays
  (`sync/merge.py`: the base restored exactly from a host copy, `release` starts that while the trainer trains);
- "folder" (`FolderSink`): the payload written as a PEFT folder and loaded from it, as a stock loader would.

A sink refuses a bad adapter (ValueError) before anything changes, and the previous one keeps serving. Nothing
here falls back to another mode: the engine's `lora_apply` picks one sink at start. After `apply`, `served(payload)`
reads back what the sink serves at the probe's positions (`sync/probe.py`, contract/served.py), under the payload's
module names. `adapter` (tensors -> tensors) renames a payload's keys to the model's modules (and may refuse them),
as an engine whose model names differ from the trainer's needs. Torch only.
"""
from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path

import numpy as np
import torch

from jaxflow_bridge.contract.lora import adapter_spec, write_peft
from jaxflow_bridge.contract.lora_payload import LoRAPayload
from jaxflow_bridge.contract.served import ServedProbe
from jaxflow_bridge.rollout.tensors import torch_to_numpy
from jaxflow_bridge.sync.layers import ADAPTER_NAME, LoraApplier, validate_pairs
from jaxflow_bridge.sync.merge import MergedLoRA
from jaxflow_bridge.sync.probe import layers_probe, merged_probe, probe_targets


def _same(tensors: dict) -> dict:
    return tensors


class _LoraLayers:
    """What the layers and folder sinks share: the model's LoRA layers (`LoraApplier`) and their probe."""

    def __init__(self, model: torch.nn.Module, adapter=None):
        self.applier = LoraApplier(model)
        self.linears = self.applier.linears
        self.adapter = adapter or _same

    def bound_modules(self) -> int:
        return self.applier.bound_modules()

    def served(self, payload: LoRAPayload) -> ServedProbe:
        """The bound LoRA layers' scale * B @ A at the probe's positions (zeros where none is bound)."""
        def factors(name):
            layer = self.applier.model.get_submodule(name) if name in self.linears else None
            if layer is None or ADAPTER_NAME not in getattr(layer, "lora_A", {}):
                return None
            return (layer.lora_A[ADAPTER_NAME].weight, layer.lora_B[ADAPTER_NAME].weight,
                    float(layer.scaling[ADAPTER_NAME]))
        with torch.no_grad():
            return layers_probe(payload, probe_targets(payload, self.adapter), factors, self.bound_modules())


class LayersSink(_LoraLayers):
    """LoRA layers on the model's Linear layers, the payload's tensors copied into them."""

    mode = "layers"

    def apply(self, payload: LoRAPayload) -> int:
        return self.applier.apply(self.adapter(payload.arrays()), payload.config)

    def release(self) -> None:
        """The step's rollouts are over: layers need nothing."""

    def settle(self) -> None:
        """Layers copy nothing in the background."""

    def check_serving(self) -> None:
        """Layers always serve the adapter last applied."""


class MergedServing:
    """What every merged sink shares (this module's and `sync/vllm_omni_sinks.py`'s): its `MergedLoRA` as `merged`,
    its `adapter` and `bound_modules()` give release, the serving check and the probe."""

    def release(self) -> None:
        """Start restoring the bare base weights; sampling is refused until the next `apply`."""
        self.merged.begin_restore()

    def settle(self) -> None:
        """Wait for the base's host copies a zero first adapter left to the background (`MergedLoRA.settle`)."""
        self.merged.settle()

    def check_serving(self) -> None:
        if self.merged.previous is not None and not self.merged.serving:
            raise RuntimeError("the merged LoRA's base weights are being restored: serve the next adapter first")

    def served(self, payload: LoRAPayload) -> ServedProbe:
        """W - W_base at the probe's positions, W the merged weight, W_base the exact base copy `MergedLoRA`
        keeps (zeros for a module never merged, or while the base is being restored)."""
        with torch.no_grad():
            return merged_probe(payload, probe_targets(payload, self.adapter), self.merged.served_slices().get,
                                self.bound_modules())


class MergedSink(MergedServing):
    """The adapter merged into the Linear layers' base weights (`MergedLoRA`), straight from the payload's arrays."""

    mode = "merged"

    def __init__(self, model: torch.nn.Module, adapter=None):
        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self.merged, self.bound, self.adapter = MergedLoRA(), 0, adapter or _same

    def apply(self, payload: LoRAPayload) -> int:
        tensors = self.adapter(payload.arrays())
        pairs = validate_pairs(self.linears, tensors, adapter_spec(payload.config).rank)
        weight = next(iter(self.linears.values())).weight
        modules = sorted(pairs)
        parts = [pairs[m][0] for m in modules] + [pairs[m][1] for m in modules]  # every A, then every B
        flat = torch.cat([p.to(weight.device, weight.dtype).reshape(-1) for p in parts])
        starts = np.cumsum([0] + [p.numel() for p in parts])
        targets = [(m, self.linears[m].weight, 0, self.linears[m].out_features,
                    int(starts[i]), tuple(pairs[m][0].shape), int(starts[len(modules) + i]), tuple(pairs[m][1].shape))
                   for i, m in enumerate(modules)]
        reply = self.merged.merge(flat, targets, payload.scale)
        if "refused" in reply:
            raise ValueError(f"LoRA adapter refused: {reply['refused']}")
        self.bound = reply["written"]
        return self.bound

    def bound_modules(self) -> int:
        return self.bound if self.merged.serving or self.merged.previous is not None else 0


class FolderSink(_LoraLayers):
    """The payload written as a PEFT folder (adapter_model.safetensors + adapter_config.json) under a temporary
    directory of the engine's, then loaded from the folder into LoRA layers; the previous folder is removed."""

    mode = "folder"

    def __init__(self, model: torch.nn.Module, adapter=None):
        super().__init__(model, adapter)
        self.root = Path(tempfile.mkdtemp(prefix="jaxflow-lora-folder-"))
        weakref.finalize(self, shutil.rmtree, self.root, True)
        self.folder = None

    def apply(self, payload: LoRAPayload) -> int:
        tensors = {k: v if isinstance(v, np.ndarray) else torch_to_numpy(v)
                   for k, v in self.adapter(payload.arrays()).items()}
        folder = write_peft(self.root / f"adapter-v{payload.version}", tensors, payload.config, replace=True)
        bound = self.applier.apply(folder)
        if self.folder is not None and self.folder != folder:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.folder = folder
        return bound

    def release(self) -> None:
        """The step's rollouts are over: a loaded folder needs nothing."""

    def settle(self) -> None:
        """A folder copies nothing in the background."""

    def check_serving(self) -> None:
        """The folder's adapter serves until the next one."""


SINKS = {"layers": LayersSink, "merged": MergedSink, "folder": FolderSink}


def make_sink(mode: str, model: torch.nn.Module, adapter=None):
    """The sink of apply mode `mode` over `model` (`adapter`: the payload's keys renamed to the model's modules);
    ValueError naming the modes."""
    if mode not in SINKS:
        raise ValueError(f"lora_apply={mode!r}; choose one of {sorted(SINKS)}")
    return SINKS[mode](model, adapter)
