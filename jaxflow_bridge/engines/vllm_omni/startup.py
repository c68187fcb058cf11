"""The vllm_omni engine's start: where torch's compile caches go and how many threads Inductor compiles with, in the
worker processes vLLM-Omni spawns (they inherit the actor's `os.environ`; our pipeline's `__init__` runs there).

- Compile caches: the diffusion stage's torch.compile keeps Inductor's FX-graph and AOTAutograd caches in
  TORCHINDUCTOR_CACHE_DIR (torch's default is under /tmp) and Triton's kernels in TRITON_CACHE_DIR. The engine config's
  `compile_cache` (the trainer's $JAXFLOW_CACHE, absent with train.compile_cache=False) pins them to `inductor/` and
  `triton/` there, beside JAX's cache, each only where the user has not set it.
- Compile threads: `import vllm` sets TORCHINDUCTOR_COMPILE_THREADS=1 in every process (vllm/env_override.py,
  unconditionally, overwriting any value), so Inductor compiles a cold start's kernels one at a time. A user's own
  value (other than 1) is read by the actor before it imports vLLM-Omni (`compile_threads`) and set as Inductor's
  `compile_threads` in the worker (`use_compile_threads`); without one, vLLM's 1 stays (its choice; more threads
  start Inductor's compile subprocesses in the worker, not yet measured there).
- Cache hits: torch counts each compile's FX-graph and AOTAutograd cache lookups in the process that compiled
  (`torch._dynamo.utils.counters`); the workers report them (`compile_cache_counts`) and the engine logs them once,
  after its first rollout, where the diffusion stage compiles (`compile_cache_line`).
"""
from __future__ import annotations

import os
from pathlib import Path

CACHE_FOLDERS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}
VLLM_COMPILE_THREADS = "1"  # what vllm/env_override.py sets
COMPILE_COUNTERS = {"fxgraph_cache_hit": "inductor", "fxgraph_cache_miss": "inductor",
                    "fxgraph_cache_bypass": "inductor", "autograd_cache_hit": "aot_autograd",
                    "autograd_cache_miss": "aot_autograd", "autograd_cache_bypass": "aot_autograd"}  # name: group


def export_compile_caches(root: str | None) -> dict:
    """TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR under `root` in this process's environment (which vLLM-Omni's
    workers inherit), each where the user has not set it; nothing with `root` None. Returns the variables set."""
    if root is None:
        return {}
    chosen = {var: str(Path(root) / folder) for var, folder in CACHE_FOLDERS.items() if not os.environ.get(var)}
    os.environ.update(chosen)
    return chosen


def compile_threads(environ=os.environ) -> int | None:
    """Inductor's compile threads for the workers: the user's TORCHINDUCTOR_COMPILE_THREADS where it is set to other
    than vLLM's 1, else None (vLLM's 1 stays). Read it before vLLM is imported in this process."""
    given = environ.get("TORCHINDUCTOR_COMPILE_THREADS", "").strip()
    if not given or given == VLLM_COMPILE_THREADS:
        return None
    try:
        return max(1, int(given))
    except ValueError:
        raise ValueError(f"TORCHINDUCTOR_COMPILE_THREADS={given!r}: set it to a whole number of threads") from None


def use_compile_threads(pipeline_args: dict) -> None:
    """In the worker: Inductor's `compile_threads` from custom_pipeline_args' `compile_threads` (the engine's
    `compile_threads`, the user's), undoing vLLM's 1; nothing where they carry none. torch keeps config overrides per thread:
    vLLM-Omni's worker builds the pipeline and runs its requests (hence the compiles) in its main thread."""
    threads = pipeline_args.get("compile_threads")
    if threads is not None:
        import torch._inductor.config

        torch._inductor.config.compile_threads = int(threads)


def compile_cache_counts(counters) -> dict[str, int]:
    """The compile caches' lookups in torch's `counters` ({group: {name: count}}) as plain ints, 0 where absent."""
    return {name: int(counters.get(group, {}).get(name, 0)) for name, group in COMPILE_COUNTERS.items()}


def compile_cache_line(counts: dict) -> str:
    """One line of `compile_cache_counts` (summed over the workers)."""
    def part(label, prefix):
        return f"{label} {counts[prefix + '_hit']} hit / {counts[prefix + '_miss']} miss / " \
               f"{counts[prefix + '_bypass']} bypass"
    return (f"vllm_omni: torch compile caches after the first rollout: {part('fx-graph', 'fxgraph_cache')}, "
            f"{part('aot-autograd', 'autograd_cache')}")
