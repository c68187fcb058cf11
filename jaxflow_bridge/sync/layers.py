"""Apply a PEFT-format LoRA adapter to the rollout transformer, atomically.

An adapter is a dict `{"<module>.lora_A.weight": (r, in), "<module>.lora_B.weight": (out, r)}` (an optional
`transformer.` prefix is stripped; values are numpy arrays or torch tensors on any device, e.g. DLPack views of
the trainer's arrays in process) plus an adapter_config with `r` and `lora_alpha` (optionally `use_rslora`).
Every key and shape is validated against the transformer's Linear layers before anything changes; on a mismatch
ValueError lists the offending names and the previous adapter keeps serving.

PEFT LoRA layers are injected (`peft.inject_adapter_in_model`) only for the modules the tensors name and only when
(rank, alpha, rslora, module set) changes; otherwise the new tensors are copied into the existing layers. The
tensors' keys, not the config's `target_modules`, decide which modules bind (exact names, so nothing binds by
accident). LoRA weights live in the transformer's dtype, as PEFT creates them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTunerLayer

from jaxflow_bridge.contract.lora import LORA_KEY, AdapterSpec, adapter_spec, read_peft, refusal
from jaxflow_bridge.rollout.tensors import numpy_to_torch

ADAPTER_NAME = "rollout"


def as_tensor(x) -> torch.Tensor:
    """An adapter array as a torch tensor (numpy shared, not copied; tensors as they are)."""
    return numpy_to_torch(x) if isinstance(x, np.ndarray) else torch.as_tensor(x)


def validate_pairs(linears: dict, tensors: dict, rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module: (A, B)} of PEFT `tensors` for the Linear layers `linears` ({name: nn.Linear}), after checking every
    key, shape and value; ValueError listing every offender (nothing changes then)."""
    errors, parts = [], {}
    for key, value in tensors.items():
        match = LORA_KEY.fullmatch(key)
        if match is None:
            errors.append(f"{key}: not a PEFT LoRA key '<module>.lora_A.weight' / '<module>.lora_B.weight'")
        elif match["module"] not in linears:
            errors.append(f"{key}: the transformer has no Linear module {match['module']!r}")
        else:
            parts.setdefault(match["module"], {})[match["part"]] = (key, as_tensor(value))
    pairs = {}
    for module, got in parts.items():
        linear = linears[module]
        want = {"A": (rank, linear.in_features), "B": (linear.out_features, rank)}
        for part in "AB":
            if part not in got:
                errors.append(f"{module}.lora_{part}.weight: missing (its lora_{'BA'[part == 'B']} is given)")
                continue
            key, t = got[part]
            if tuple(t.shape) != want[part]:
                errors.append(f"{key}: expected shape {want[part]}, got {tuple(t.shape)}")
            elif not t.is_floating_point() or not torch.isfinite(t).all():
                errors.append(f"{key}: expected finite floating-point values")
        if len(got) == 2:
            pairs[module] = (got["A"][1], got["B"][1])
    if errors:
        raise refusal(errors, "offending tensors")
    if not pairs:
        raise ValueError("LoRA adapter refused: it binds zero modules (no lora_A/lora_B tensors given); "
                         "the previous adapter keeps serving")
    return pairs


class LoraApplier:
    """Owns the LoRA layers of one model: validate, (re-)inject when needed, copy tensors, count bound modules."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self.spec: AdapterSpec | None = None

    def apply(self, tensors, adapter_config: dict | None = None) -> int:
        """Serve `tensors` (dict or PEFT path) as the adapter; returns the number of bound modules."""
        if isinstance(tensors, (str, Path)):
            tensors, file_config = read_peft(tensors)
            adapter_config = adapter_config or file_config
        if adapter_config is None:
            if self.spec is None:
                raise ValueError("adapter_config (r, lora_alpha) is required for the first LoRA update")
            spec = self.spec
        else:
            spec = adapter_spec(adapter_config)
        pairs = validate_pairs(self.linears, tensors, spec.rank)
        spec = dataclasses.replace(spec, modules=tuple(sorted(pairs)))
        if spec != self.spec:
            self._inject(spec)
        devices = set()
        with torch.no_grad():
            for name, (a, b) in pairs.items():
                layer = self.model.get_submodule(name)
                weights = layer.lora_A[ADAPTER_NAME].weight, layer.lora_B[ADAPTER_NAME].weight
                for target, source in zip(weights, (a, b)):
                    target.copy_(source)
                    devices.update((target.device, source.device))
        # The sources may be borrowed (in process: DLPack views of the trainer's JAX buffers, which JAX may reuse
        # as soon as the caller drops them), so the copies, asynchronous on a GPU, have finished when this returns.
        for device in devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return self.bound_modules()

    def bound_modules(self) -> int:
        """LoRA-wrapped Linear layers currently carrying the adapter."""
        return sum(isinstance(m, BaseTunerLayer) and ADAPTER_NAME in m.lora_A for m in self.model.modules())

    def _inject(self, spec: AdapterSpec) -> None:
        """Drop any existing LoRA layers, then wrap exactly `spec.modules`."""
        for name, module in list(self.model.named_modules()):
            if isinstance(module, BaseTunerLayer):
                parent, _, child = name.rpartition(".")
                setattr(self.model.get_submodule(parent), child, module.get_base_layer())
        if hasattr(self.model, "peft_config"):  # left by the previous injection
            delattr(self.model, "peft_config")
        config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, use_rslora=spec.rslora, lora_dropout=0.0,
                            target_modules=list(spec.modules))
        inject_adapter_in_model(config, self.model, adapter_name=ADAPTER_NAME)
        self.model.eval()
        self.spec = spec
