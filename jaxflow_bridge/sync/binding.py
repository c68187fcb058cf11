"""Binding a PEFT adapter to vLLM-Omni's LoRA-capable layers, checked before the engine sees it: which engine layer
(and which slice of a fused q/k/v layer) each adapter module lands on, with shapes and values checked, and the
plan for writing a shared adapter file (jaxflow_bridge/contract/lora_shm.py) into the engine in place. `table` is
`jaxflow_bridge.sync.vllm_omni_slots.lora_module_table` of the engine's transformer. Numpy only."""
from __future__ import annotations

import numpy as np

from jaxflow_bridge.contract.lora import lora_pairs, refusal, to_vllm_omni
from jaxflow_bridge.contract.lora_shm import offsets


def bind_lora_modules(pairs: dict, rank: int, table: dict, check_values: bool = True) -> dict:
    """{module: (engine layer, slot)} binding every adapter module (vLLM-Omni names) to an engine layer.

    pairs: {module: (lora_A, lora_B)}, arrays (or, with check_values=False, anything with a shape); table:
    `jaxflow_bridge.sync.vllm_omni_slots.lora_module_table` of the engine transformer. A module binds to the layer of its name (slot
    None: B spans all of a fused layer's slices), or to its slot of a fused layer through `packed` (`to_q` -> slice 0
    of `to_qkv`). ValueError listing every module that binds nowhere, has a wrong shape or (check_values)
    non-finite values, or if none binds.
    """
    modules, errors, bound = table["modules"], [], {}
    slots = {part: (fused, i) for fused, parts in table["packed"].items() for i, part in enumerate(parts)}
    for name, (a, b) in sorted(pairs.items()):
        prefix, _, leaf = name.rpartition(".")
        fused, slot = slots.get(leaf, (None, None))
        target = name if name in modules else f"{prefix}.{fused}" if fused else None
        if target not in modules:
            errors.append(f"{name}: the engine transformer has no such LoRA-capable layer")
            continue
        fan_in, outs = modules[target]
        out = sum(outs) if target == name else outs[slot]
        for part, got, want in (("lora_A", a, (rank, fan_in)), ("lora_B", b, (out, rank))):
            if tuple(np.shape(got)) != want:
                errors.append(f"{name}.{part}.weight: expected shape {want} (engine layer {target}), "
                              f"got {tuple(np.shape(got))}")
            elif check_values and not np.isfinite(got).all():
                errors.append(f"{name}.{part}.weight: expected finite values")
        bound[name] = (target, None if target == name else slot)
    if errors:
        raise refusal(errors, "modules that do not bind")
    if not pairs:
        raise ValueError("LoRA adapter refused: it binds zero modules; the previous adapter keeps serving")
    return bound


def check_lora_binding(pairs: dict, rank: int, table: dict) -> int:
    """How many adapter modules bind (`bind_lora_modules`, values checked)."""
    return len(bind_lora_modules(pairs, rank, table))


def slot_plan(manifest: dict, rank: int, table: dict) -> tuple[list, int]:
    """(plan, first B offset) for writing a shared adapter file (jaxflow_bridge/contract/lora_shm.py) into the engine's
    LoRA slots: one [module, layer, slot, A offset, A shape, B offset, B shape] per module (vLLM-Omni names, slot 0
    for an unfused layer), shapes checked against the engine (`bind_lora_modules`, values not: the workers check
    them on the GPU). ValueError if the file's B tensors do not all follow its A tensors."""
    entries, starts = manifest["entries"], offsets(manifest["entries"])
    where = to_vllm_omni({k: (starts[i], list(s)) for i, (k, s) in enumerate(entries)})
    pairs = lora_pairs(where)
    shapes = {m: (np.broadcast_to(np.uint8(0), a[1]), np.broadcast_to(np.uint8(0), b[1])) for m, (a, b) in pairs.items()}
    plan = []
    for m, (layer, slot) in sorted(bind_lora_modules(shapes, rank, table, check_values=False).items()):
        if slot is None and len(table["modules"][layer][1]) > 1:
            raise ValueError(f"{m}: a LoRA over all slices of the fused layer {layer} is not written in place")
        plan.append([m, layer, slot or 0, *pairs[m][0], *pairs[m][1]])
    first_b = min(p[5] for p in plan)
    if max(p[3] for p in plan) > first_b:
        raise ValueError("shared LoRA file: its lora_B tensors must all follow its lora_A tensors")
    return plan, first_b
