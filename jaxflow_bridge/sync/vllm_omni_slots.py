"""vLLM-Omni 0.20's LoRA slots from the worker's side (the workers of `vllm_omni.engine`, through
`vllm_omni.pipeline.RolloutWorkerExtension`): the pipeline component vLLM-Omni's LoRA manager wraps, the table of
its LoRA-capable layers the engine checks adapters against (`jaxflow_bridge/sync/binding.py`), the in-place
write of a shared adapter into the active adapter's slots, and the shared adapter file mapped into the worker.
Imports no vLLM."""
from __future__ import annotations

import torch


def lora_component(pipeline) -> tuple[str, torch.nn.Module]:
    """(name, module) of the pipeline part whose layers vLLM-Omni's LoRA manager wraps, as our pipeline classes
    name it in `lora_component`, their family spec's `LORA_COMPONENT` (the manager's full layer names start with
    it)."""
    return pipeline.lora_component, getattr(pipeline, pipeline.lora_component)


def _leaf(suffix: str) -> str:
    return suffix.strip(".").split(".")[-1]


def packed_modules(component: torch.nn.Module) -> dict[str, list[str]]:
    """{fused layer leaf: [slice leaves, in slot order]}: what vLLM-Omni's LoRA manager derives from its modules'
    `stacked_params_mapping` entries (fused suffix, slice suffix, shard id), which their `load_weights` set (a component
    whose class has no `packed_modules_mapping` declares its fused layers only there), with the component class's
    `packed_modules_mapping`, where it has one, taking precedence."""
    derived: dict[str, list[str]] = {}
    for module in component.modules():
        for fused, part, *_ in getattr(module, "stacked_params_mapping", None) or ():
            parts = derived.setdefault(_leaf(fused), [])
            if _leaf(part) not in parts:
                parts.append(_leaf(part))
    declared = getattr(type(component), "packed_modules_mapping", {})
    return {**derived, **{k: list(v) for k, v in declared.items()}}


def lora_module_table(component: torch.nn.Module) -> dict:
    """{"modules": {name: [in, [out per slice]]}, "packed": `packed_modules(component)`} of vLLM's linear layers
    (anything with `input_size` and `output_size`; fused ones list `output_sizes`), names relative to the
    component."""
    modules = {name: [int(m.input_size), [int(s) for s in getattr(m, "output_sizes", [m.output_size])]]
               for name, m in component.named_modules()
               if hasattr(m, "input_size") and hasattr(m, "output_size")}
    return {"modules": modules, "packed": packed_modules(component)}


def write_lora_slots(manager, payload: torch.Tensor, plan: list, first_b: int, scale: float, adapter_id: int,
                     component: str) -> dict:
    """Write a shared adapter's tensors into vLLM-Omni's LoRA slots in place (the worker side of
    `VllmOmniEngine.update_lora_shared`); {"written": n}, or {"refused": [...]} with nothing written.

    `manager`: vLLM-Omni 0.20's `DiffusionLoRAManager` with adapter `adapter_id` active; its wrapped layers hold the
    active adapter in `lora_a_stacked[slot][0, 0, :r]` (r, in) and `lora_b_stacked[slot][0, 0, :, :r]` (out, r),
    B already multiplied by alpha/r (vllm_omni/diffusion/lora/layers/base_linear.py, manager.py `_activate_adapter`),
    and keeps a CPU copy of it (`_registered_adapters[id].get_lora(module)`) that a re-activation would copy back:
    both are written. `payload`: the file's flat tensors on the GPU (B from `first_b` on, unscaled as PEFT stores
    it); `component`: `lora_component`'s name, which starts the manager's layer names. RuntimeError (not a refusal)
    when the manager does not look like that.
    """
    if getattr(manager, "_active_adapter_id", None) != adapter_id:
        raise RuntimeError(f"LoRA adapter {adapter_id} is not the active one ({manager._active_adapter_id})")
    model, layers = manager._registered_adapters[adapter_id], manager._lora_modules
    targets = []
    for module, layer, slot, a_off, a_shape, b_off, b_shape in plan:  # resolve everything before any write
        wrapped = layers.get(layer, layers.get(f"{component}.{layer}"))
        master = model.get_lora(module)
        if wrapped is None or master is None or tuple(master.lora_a.shape) != tuple(a_shape) \
                or tuple(master.lora_b.shape) != tuple(b_shape):
            raise RuntimeError(f"{module}: no wrapped layer {layer} or held adapter weights of its shapes")
        r = a_shape[0]
        slots = (wrapped.lora_a_stacked[slot][0, 0, :r], wrapped.lora_b_stacked[slot][0, 0, :, :r])
        targets.append((module, slots, master, payload[a_off:a_off + r * a_shape[1]].view(*a_shape),
                        payload[b_off:b_off + b_shape[0] * r].view(*b_shape)))
    payload[first_b:].mul_(scale)
    if not bool(torch.isfinite(payload).all()):
        return {"refused": [f"{m}: expected finite values" for m, _, _, a, b in targets
                            if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all()))]}
    for _, (slot_a, slot_b), master, a, b in targets:
        slot_a.copy_(a)
        slot_b.copy_(b)
        master.lora_a.copy_(a, non_blocking=True)
        master.lora_b.copy_(b, non_blocking=True)
    if payload.is_cuda:
        torch.cuda.synchronize(payload.device)
    return {"written": len(targets)}


def served_lora(manager, adapter_id: int, component: str, module: str, layer: str, slot: int | None,
                rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A (r, in), B (out, r) times alpha / r) of adapter `adapter_id`'s `module` as vLLM-Omni 0.20's manager
    holds it (see `write_lora_slots`): the wrapped `layer`'s slots of `slot` (None: every slice, B's rows stacked)
    while that adapter is active, else the CPU copy its next activation (a request carrying it) copies in."""
    if getattr(manager, "_active_adapter_id", None) != adapter_id:
        held = manager._registered_adapters[adapter_id].get_lora(module)
        return held.lora_a, held.lora_b
    layers = manager._lora_modules
    wrapped = layers.get(layer, layers.get(f"{component}.{layer}"))
    slots = range(len(wrapped.lora_a_stacked)) if slot is None else [slot]
    a = wrapped.lora_a_stacked[slots[0]][0, 0, :rank]
    return a, torch.cat([wrapped.lora_b_stacked[s][0, 0, :, :rank] for s in slots])


class MappedPayload:
    """A shared adapter file mapped into this process once (torch.from_file, shared) and, on a GPU, page-locked
    (cudaHostRegister) so that each step's copy to the GPU runs at pinned speed; remapped when the path or size
    changes."""

    def __init__(self):
        self.key, self.host, self.registered = None, None, False

    def to(self, manifest: dict, device) -> torch.Tensor:
        """The manifest's payload as a fresh tensor on `device` (the file's token and size are the engine's to
        check: it runs on this host)."""
        from jaxflow_bridge.contract.lora_shm import TOKEN_BYTES, dtype_of, offsets
        total = offsets(manifest["entries"])[-1]
        itemsize = dtype_of(manifest["dtype"]).itemsize
        key = (manifest["path"], total, manifest["dtype"])
        if key != self.key:
            self.close()
            raw = torch.from_file(manifest["path"], shared=True, size=TOKEN_BYTES + total * itemsize,
                                  dtype=torch.uint8)
            self.host = raw[TOKEN_BYTES:].view(getattr(torch, manifest["dtype"]))
            if torch.device(device).type == "cuda":
                err = torch.cuda.cudart().cudaHostRegister(self.host.data_ptr(), total * itemsize, 0)
                self.registered = int(err) == 0
            self.key = key
        return self.host.to(device, non_blocking=self.registered, copy=True)

    def close(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.host.data_ptr())
        self.key, self.host, self.registered = None, None, False
