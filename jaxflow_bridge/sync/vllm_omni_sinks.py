"""vLLM-Omni's LoRA sinks, one per apply mode, on the worker side where the weights are (`RolloutWorkerMethods` in
jaxflow_bridge/engines/vllm_omni/worker.py calls them; the engine process only routes the payload and returns the
reply). Same interface as jaxflow_bridge/sync/sinks.py: `apply(payload) -> bound`, `bound_modules`, `release`,
`check_serving`, `served(payload)`.

- "layers" (`SlotsSink`): the adapter vLLM-Omni's `add_lora` loaded first (`loaded`), then each payload written in
  place into its LoRA slots (`vllm_omni_slots.write_lora_slots`);
- "folder" (`FolderSlotsSink`): every payload loaded by `add_lora` from a PEFT folder; the sink only reads back;
- "merged" (`MergedSlotsSink`): the adapter merged into the base weights (`sync/merge.py`), no LoRA layers.

The payload (`contract.lora_payload.LoRAPayload`) reaches the workers as an argument of vLLM-Omni's `collective_rpc`,
in plain values (`to_wire`, rebuilt by the worker with `from_wire`: msgpack carries it between a two-stage
deployment's processes): the arrays themselves, or a shared file's manifest only, which the worker maps
(`MappedPayload`). Either way it lands on the weights' device as one flat tensor (lora_A tensors first) in one copy.
`adapter` renames the payload's PEFT keys to vLLM-Omni's module names (the engine's kind's renames); `served`
answers under the payload's own names. A bad adapter is refused (ValueError) with nothing written; a manager that
does not look like vLLM-Omni 0.20's is a RuntimeError. Torch only.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from jaxflow_bridge.contract.lora import LORA_KEY, adapter_spec, lora_pairs, refusal
from jaxflow_bridge.contract.lora_payload import LoRAPayload
from jaxflow_bridge.contract.served import ServedProbe
from jaxflow_bridge.sync import vllm_omni_slots
from jaxflow_bridge.sync.binding import bind_lora_modules, slot_plan
from jaxflow_bridge.sync.merge import plan_targets
from jaxflow_bridge.sync.layers import as_tensor
from jaxflow_bridge.sync.probe import layers_probe, probe_targets
from jaxflow_bridge.sync.sinks import MergedServing
from jaxflow_bridge.sync.vllm_omni_slots import MappedPayload, lora_component, lora_module_table


class Renames:
    """A payload's PEFT keys under vLLM-Omni's module names: {PEFT module: vLLM-Omni module}, as the engine's kind
    renames them (a plain mapping, so it crosses to the workers)."""

    def __init__(self, modules: dict[str, str]):
        self.modules = dict(modules)

    def __call__(self, tensors: dict) -> dict:
        out = {}
        for key, value in tensors.items():
            match = LORA_KEY.fullmatch(key)
            out[f"{self.modules.get(match['module'], match['module'])}.lora_{match['part']}.weight"] = value
        return out


class _VllmOmniSink:
    """What every vLLM-Omni sink shares: the pipeline's LoRA component, its layer table, the payload on the device."""

    mode = ""

    def __init__(self, pipeline, manager: Callable[[], object]):
        self.manager = manager
        self.name, self.component = lora_component(pipeline)
        self.table = lora_module_table(self.component)
        self.mapped = MappedPayload()
        self.adapter = Renames({})
        self.binding: dict[str, tuple[str, int | None]] = {}  # vLLM-Omni module: (engine layer, slot)

    def bind(self, payload: LoRAPayload) -> dict:
        """{vLLM-Omni module: (layer, slot)} of the payload (shapes checked; ValueError listing offenders)."""
        shapes = {k: np.broadcast_to(np.uint8(0), s) for k, s in self.adapter(self._entries(payload)).items()}
        return bind_lora_modules(lora_pairs(shapes), adapter_spec(payload.config).rank, self.table, check_values=False)

    @staticmethod
    def _entries(payload: LoRAPayload) -> dict:
        """{PEFT key: shape} in the order the flat payload holds them (lora_A tensors first)."""
        if payload.shared is not None:
            return {k: tuple(s) for k, s in payload.shared["entries"]}
        arrays = payload.arrays()
        return {k: tuple(arrays[k].shape) for k in sorted(arrays, key=lambda k: (".lora_B." in k, k))}

    def flat(self, payload: LoRAPayload, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, dict]:
        """(the payload as one fresh flat tensor on the component's device, a manifest of it in vLLM-Omni names)."""
        device = next(self.component.parameters()).device
        entries = self._entries(payload)
        if payload.shared is not None:
            flat = self.mapped.to(payload.shared, device)
        else:
            arrays = payload.arrays()
            flat = torch.cat([as_tensor(arrays[k]).reshape(-1) for k in entries]).to(device)
        flat = flat if dtype is None else flat.to(dtype)
        return flat, {"entries": [(k, list(s)) for k, s in self.adapter(entries).items()]}

    def bound_modules(self) -> int:
        return len(self.binding)

    def release(self) -> None:
        """The step's rollouts are over: LoRA slots need nothing."""

    def settle(self) -> None:
        """LoRA slots copy nothing in the background."""

    def check_serving(self) -> None:
        """The slots serve the adapter last applied."""


class SlotsSink(_VllmOmniSink):
    """lora_apply="layers": vLLM-Omni's LoRA slots, the first adapter loaded by `add_lora` (`loaded`), every later
    one written in place into them."""

    mode = "layers"

    def __init__(self, pipeline, manager):
        super().__init__(pipeline, manager)
        self.adapter_id, self.rank = None, 0

    def loaded(self, payload: LoRAPayload, adapter_id: int) -> int:
        """The engine's `add_lora` loaded `payload` as adapter `adapter_id`; its binding, counted."""
        self.binding, self.adapter_id = self.bind(payload), adapter_id
        self.rank = adapter_spec(payload.config).rank
        return len(self.binding)

    def apply(self, payload: LoRAPayload) -> int:
        binding = self.bind(payload)
        if self.adapter_id is None:
            raise RuntimeError("no adapter loaded by add_lora to write in place into")
        flat, manifest = self.flat(payload)
        plan, first_b = slot_plan(manifest, adapter_spec(payload.config).rank, self.table)
        reply = vllm_omni_slots.write_lora_slots(self.manager(), flat, plan, first_b, payload.scale, self.adapter_id,
                                                 self.name)
        if "refused" in reply:
            raise refusal(reply["refused"], "modules with non-finite values")
        self.binding, self.rank = binding, adapter_spec(payload.config).rank
        return reply["written"]

    def _factors(self, module: str):
        """(A, B times alpha / r, 1.0) of a bound module as the manager holds them (`served_lora`)."""
        if module not in self.binding or self.adapter_id is None:
            return None
        return (*vllm_omni_slots.served_lora(self.manager(), self.adapter_id, self.name, module,
                                             *self.binding[module], self.rank), 1.0)

    def served(self, payload: LoRAPayload) -> ServedProbe:
        """The served B @ A (B holding alpha / r) at the probe's positions, read from the manager's tensors."""
        with torch.no_grad():
            return layers_probe(payload, probe_targets(payload, self.adapter), self._factors, self.bound_modules())


class FolderSlotsSink(SlotsSink):
    """lora_apply="folder": every payload loaded by vLLM-Omni's `add_lora` from a PEFT folder the engine writes;
    nothing is written here, the sink reads back what the loader bound."""

    mode = "folder"

    def apply(self, payload: LoRAPayload) -> int:
        raise RuntimeError("lora_apply='folder' loads every adapter with add_lora; nothing is written in place")


class MergedSlotsSink(MergedServing, _VllmOmniSink):
    """lora_apply="merged": the adapter merged into the component's base weights by the pipeline's `MergedLoRA`
    (restored exactly from its host copy before each merge), straight from the payload."""

    mode = "merged"

    def __init__(self, pipeline, manager):
        super().__init__(pipeline, manager)
        self.merged = pipeline.merged_lora

    def apply(self, payload: LoRAPayload) -> int:
        binding = self.bind(payload)
        weight = next(self.component.parameters())
        flat, manifest = self.flat(payload, weight.dtype)
        plan, _ = slot_plan(manifest, adapter_spec(payload.config).rank, self.table)
        reply = self.merged.merge(flat, plan_targets(self.component, plan, self.table), payload.scale)
        if "refused" in reply:
            raise refusal(reply["refused"], "modules with non-finite values")
        self.binding = binding
        return reply["written"]

    def serve_again(self) -> int:
        """The previous adapter merged again, after the engine refused a new one while the base was restored."""
        if self.merged.previous is not None and not self.merged.serving:
            return self.merged.merge(*self.merged.previous)["written"]
        return 0


SINKS = {"layers": SlotsSink, "folder": FolderSlotsSink, "merged": MergedSlotsSink}
