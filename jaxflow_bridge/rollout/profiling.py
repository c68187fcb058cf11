"""torch.profiler around a rollout pipeline's next calls, read back as plain lists (what
jaxflow_bench.rollout_profile categorises): in the engine's process (the diffusers engine) or in vLLM-Omni's workers
(their `rollout_profile_start` / `rollout_profile_stop` RPCs, jaxflow_bridge/engines/vllm_omni/worker.py). While it
records, the pipeline's text encoder, VAE decode and whole generate run under profiler ranges named for their phase.
"""
from __future__ import annotations

import torch
from torch.autograd import DeviceType

# profiler range -> the pipeline method it covers (SamplingLoop's `encode`, `decode`, `generate`)
PHASES = {"text_encoder": "encode", "vae_decode": "decode", "sample": "generate"}
_ABSENT = object()


def _ranged(name: str, fn):
    """`fn` under a torch.profiler range `name`."""
    def call(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)
    return call


class PipelineProfiler:
    """One recording of `pipeline`'s calls between `start` and `stop`: CUDA kernels with `cuda` (the CPU side is
    recorded too, for the phase ranges: its ops are not rows), else CPU ops."""

    def __init__(self, pipeline, cuda: bool):
        self.pipeline, self.cuda = pipeline, cuda
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        self.profiler = torch.profiler.profile(activities=activities)
        self.replaced: dict[str, object] = {}

    def start(self) -> None:
        for phase, method in PHASES.items():
            if hasattr(self.pipeline, method):
                self.replaced[method] = vars(self.pipeline).get(method, _ABSENT)
                setattr(self.pipeline, method, _ranged(phase, getattr(self.pipeline, method)))
        self.profiler.start()

    def stop(self) -> dict:
        """{"rows": [[kernel or op name, its own seconds], ...] (CUDA kernels, or CPU ops; no ranges),
        "phases": {range: its seconds in all}} of everything recorded since `start`; the pipeline unwrapped."""
        self.profiler.stop()
        for method, before in self.replaced.items():
            if before is _ABSENT:
                delattr(self.pipeline, method)
            else:
                setattr(self.pipeline, method, before)
        self.replaced = {}
        device = DeviceType.CUDA if self.cuda else DeviceType.CPU
        rows, phases = [], {}
        for e in self.profiler.key_averages():
            if e.is_user_annotation:
                if e.key in PHASES and e.device_type == DeviceType.CPU:
                    phases[e.key] = e.cpu_time_total / 1e6
            elif e.device_type == device:
                rows.append([e.key, (e.self_device_time_total if self.cuda else e.self_cpu_time_total) / 1e6])
        return {"rows": rows, "phases": phases}
