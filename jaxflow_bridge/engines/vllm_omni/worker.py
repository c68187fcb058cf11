"""The extension of vLLM-Omni 0.20's diffusion worker our engine starts its workers with (`WORKER_EXTENSION_CLASS`,
built on first attribute access, PEP 562, so this module imports without vLLM-Omni): `rollout_lora_modules()`, the
pipeline's LoRA-capable layers and their shapes (the engine checks adapters against it), the in-place LoRA write into
vLLM-Omni's slots, and with lora_apply="merged" the merge into the base weights and its restore."""
from __future__ import annotations

from jaxflow_bridge.sync.merge import plan_targets
from jaxflow_bridge.sync.vllm_omni_slots import MappedPayload, lora_component, lora_module_table, write_lora_slots

WORKER_EXTENSION_CLASS = f"{__name__}.RolloutWorkerExtension"


class RolloutWorkerMethods:
    """What `RolloutWorkerExtension` adds to vLLM-Omni's diffusion worker (its `model_runner.pipeline`, one of our
    pipeline classes, and its `lora_manager`); a plain mixin, so tests can call it on a stand-in worker."""

    def rollout_lora_modules(self) -> dict:
        return lora_module_table(lora_component(self.model_runner.pipeline)[1])

    def rollout_random_fingerprint(self) -> str | None:
        return self.model_runner.pipeline.random_fingerprint

    def rollout_write_lora(self, manifest: dict, plan: list, first_b: int, scale: float, adapter_id: int) -> dict:
        if not hasattr(self, "_rollout_payload"):
            self._rollout_payload = MappedPayload()
        name, component = lora_component(self.model_runner.pipeline)
        device = next(component.parameters()).device
        try:
            return write_lora_slots(self.lora_manager, self._rollout_payload.to(manifest, device), plan, first_b,
                                    scale, adapter_id, name)
        except (RuntimeError, AttributeError, KeyError) as e:  # reported as an RPC error: the engine falls back
            return {"error": True, "reason": f"{type(e).__name__}: {e}"}

    def rollout_merge_lora(self, manifest: dict | None, plan: list, scale: float) -> dict:
        """lora_apply="merged": the shared file's adapter merged into the base weights (manifest None: the previous
        adapter merged again, after the engine refused a new one)."""
        pipeline = self.model_runner.pipeline
        merged = pipeline.merged_lora
        try:
            if manifest is None:
                serve_again = merged.previous is not None and not merged.serving
                return merged.merge(*merged.previous) if serve_again else {"written": 0}
            if not hasattr(self, "_rollout_payload"):
                self._rollout_payload = MappedPayload()
            if not hasattr(self, "_rollout_table"):  # the transformer's layers do not change: read them once
                self._rollout_table = lora_module_table(pipeline.transformer)
            device = next(pipeline.transformer.parameters()).device
            targets = plan_targets(pipeline.transformer, plan, self._rollout_table)
            return merged.merge(self._rollout_payload.to(manifest, device), targets, scale)
        except (RuntimeError, AttributeError, KeyError) as e:  # reported as an RPC error
            return {"error": True, "reason": f"{type(e).__name__}: {e}"}

    def rollout_restore_base(self) -> dict:
        """lora_apply="merged": start restoring the bare base weights (they copy back while the trainer trains)."""
        merged = self.model_runner.pipeline.merged_lora
        if merged is not None:
            merged.begin_restore()
        return {"restoring": merged is not None}


def _worker_extension_class() -> type:
    from vllm_omni.diffusion.worker.diffusion_worker import (
        CustomPipelineWorkerExtension,
    )

    return type("RolloutWorkerExtension", (RolloutWorkerMethods, CustomPipelineWorkerExtension), {"__module__": __name__})


_LAZY = {"RolloutWorkerExtension": _worker_extension_class}


def __getattr__(name: str):
    """Build (once) the class that needs vLLM-Omni, when vLLM-Omni's loader asks for it by name."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = _LAZY[name]()
    return value
