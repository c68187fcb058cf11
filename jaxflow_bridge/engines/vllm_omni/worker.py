"""The extension of vLLM-Omni 0.20's diffusion worker our engine starts its workers with (`WORKER_EXTENSION_CLASS`,
built on first attribute access, PEP 562, so this module imports without vLLM-Omni): `rollout_lora_modules()`, the
pipeline's LoRA-capable layers and their shapes (the engine checks adapters against it), the worker's LoRA sink
(jaxflow_bridge/sync/vllm_omni_sinks.py, one per apply mode): each update's payload applied and read back, a
torch.profiler around the requests it serves (`rollout_profile_start` / `rollout_profile_stop`), and its torch
compile caches' lookups (`rollout_compile_cache_counts`)."""
from __future__ import annotations

from jaxflow_bridge.contract.lora_payload import LoRAPayload
from jaxflow_bridge.engines.vllm_omni.startup import compile_cache_counts
from jaxflow_bridge.rollout.profiling import PipelineProfiler
from jaxflow_bridge.sync.vllm_omni_sinks import SINKS, Renames
from jaxflow_bridge.sync.vllm_omni_slots import lora_component, lora_module_table

WORKER_EXTENSION_CLASS = f"{__name__}.RolloutWorkerExtension"
_FAILURES = (RuntimeError, AttributeError, KeyError, IndexError, TypeError)  # a manager unlike vLLM-Omni 0.20's


class RolloutWorkerMethods:
    """What `RolloutWorkerExtension` adds to vLLM-Omni's diffusion worker (its `model_runner.pipeline`, one of our
    pipeline classes, and its `lora_manager`); a plain mixin, so tests can call it on a stand-in worker. Arguments
    and replies are plain values (dicts, lists, str, numbers, uint8 arrays): vLLM-Omni pickles them to a one-stage
    deployment's workers but sends a several-stage one's through msgpack, which turns a dataclass into a dict.
    Replies: a refused adapter {"refused": reason}, a failure {"error": True, "reason"} (the engine raises it)."""

    def rollout_lora_modules(self) -> dict:
        return lora_module_table(lora_component(self.model_runner.pipeline)[1])

    def rollout_random_fingerprint(self) -> str | None:
        return self.model_runner.pipeline.random_fingerprint

    def rollout_sink(self, mode: str):
        """The worker's LoRA sink of apply mode `mode`, made on first use."""
        sink = getattr(self, "_rollout_sink", None)
        if sink is None or sink.mode != mode:
            sink = self._rollout_sink = SINKS[mode](self.model_runner.pipeline, lambda: self.lora_manager)
        return sink

    def rollout_apply_lora(self, mode: str, wire: dict, names: dict, loaded_id: int | None = None) -> dict:
        """Serve the payload (`LoRAPayload.to_wire()`'s plain values, PEFT names; `names`: {PEFT module: vLLM-Omni
        module}) through the mode's sink: written by it, or (`loaded_id`) already loaded by the engine's `add_lora`
        as that adapter; {"written": modules bound, "served": what the sink now serves (contract/served.py)}."""
        sink = self.rollout_sink(mode)
        sink.adapter = Renames(names)
        try:
            payload = LoRAPayload.from_wire(wire)
            bound = sink.apply(payload) if loaded_id is None else sink.loaded(payload, loaded_id)
            return {"written": bound, "served": sink.served(payload).to_dict()}
        except ValueError as e:
            return {"refused": str(e)}
        except _FAILURES as e:
            return {"error": True, "reason": f"{type(e).__name__}: {e}"}

    def rollout_serve_again(self) -> dict:
        """lora_apply="merged": the previous adapter merged again (the engine refused a new one after the base
        began restoring)."""
        try:
            return {"written": self.rollout_sink("merged").serve_again()}
        except _FAILURES as e:
            return {"error": True, "reason": f"{type(e).__name__}: {e}"}

    def rollout_restore_base(self) -> dict:
        """lora_apply="merged": start restoring the bare base weights (they copy back while the trainer trains)."""
        self.rollout_sink("merged").release()
        return {"restoring": True}

    def rollout_settle(self) -> dict:
        """lora_apply="merged": wait for the base's host copies still in flight, before the weights move (sleep)."""
        try:
            self.rollout_sink("merged").settle()
            return {"settled": True}
        except _FAILURES as e:
            return {"error": True, "reason": f"{type(e).__name__}: {e}"}

    def rollout_profile_start(self, cuda: bool) -> dict:
        """Start torch.profiler (CUDA kernels with `cuda`, else CPU ops) around the requests this worker serves until
        `rollout_profile_stop`, its pipeline's phases under ranges (jaxflow_bridge/rollout/profiling.py)."""
        if getattr(self, "_rollout_profiler", None) is not None:
            return {"error": True, "reason": "a rollout profile is recording already: rollout_profile_stop first"}
        self._rollout_profiler = PipelineProfiler(self.model_runner.pipeline, cuda)
        self._rollout_profiler.start()
        return {"recording": True}

    def rollout_profile_stop(self) -> dict:
        """The recording's table ({"rows": [[name, own seconds]], "phases": {range: seconds}}, plain lists for the
        RPC's reply); the pipeline unwrapped."""
        profiler, self._rollout_profiler = getattr(self, "_rollout_profiler", None), None
        if profiler is None:
            return {"error": True, "reason": "no rollout profile is recording: rollout_profile_start first"}
        return profiler.stop()

    def rollout_compile_cache_counts(self) -> dict:
        """This worker's FX-graph and AOTAutograd cache hits, misses and bypasses so far (plain ints)."""
        from torch._dynamo.utils import counters

        return compile_cache_counts(counters)


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
