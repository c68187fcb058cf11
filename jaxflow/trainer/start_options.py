"""XLA options the train step compiles with on a GPU for a quicker start, beside train.xla_options (whose values
win), each only where the installed XLA knows it (an unknown compile option fails the compile):

- xla_gpu_experimental_aot_compiled_thunks: a serialized executable (the executable cache's,
  `jaxflow.trainer.executable_cache`, and JAX's persistent cache's) holds XLA's thunks. Without it a load rebuilds
  them: XLA's legacy loader (`LegacyGpuAotCompilationResult`) parses the module, rebuilds the buffer assignment and
  re-runs the IR emitter over the whole module (Triton fusions lowered again), which is most of a warm start's
  load; with it the loader (`GpuExecutable::FromProto`) reads the thunks back. XLA reads it when it exports an
  executable; the compiled program is the same.
- xla_gpu_enable_llvm_module_compilation_parallelism: XLA splits the step's LLVM module and compiles the parts to
  GPU code in its thread pool (one thread a core) instead of in one piece; the HLO passes and autotuning are as
  before."""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)
GPU_OPTIONS = {"xla_gpu_experimental_aot_compiled_thunks": True,
               "xla_gpu_enable_llvm_module_compilation_parallelism": True}
GPU_BACKENDS = ("gpu", "cuda", "rocm")


def with_start_options(options) -> dict:
    """`options` (the step's XLA options) with the `GPU_OPTIONS` the installed XLA knows added on a GPU backend
    (`options`' own values win); `options` unchanged elsewhere."""
    if jax.default_backend() not in GPU_BACKENDS:
        return dict(options)
    return {**{name: value for name, value in GPU_OPTIONS.items() if known(name, value)}, **options}


@functools.cache
def known(name: str, value) -> bool:
    """Whether XLA compiles a one-line program with the option `name`=`value` (once a process; a line where not)."""
    try:
        jax.jit(jnp.negative, compiler_options={name: value}).lower(jax.ShapeDtypeStruct((), jnp.float32)).compile()
    except Exception as exc:  # noqa: BLE001 - XLA's error for an option it lacks has no type of its own
        log.info("XLA option %s left out: %s", name, str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
        return False
    return True
