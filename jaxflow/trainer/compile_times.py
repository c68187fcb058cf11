"""Ahead-of-time compiles timed by stage, for the start-up line's memory plan: tracing and lowering (Python's work,
redone at every start: the persistent compilation cache is keyed by the lowered program) and XLA's compile (on a warm
start served by that cache, `jaxflow.config.machine.compilation_cache`); a compile the executable cache serves
(`jaxflow.trainer.executable_cache`) shows as trace 0, lower 0 and compile = the load's seconds."""
from __future__ import annotations

import dataclasses
import time

import jax

CACHE_HITS = "/jax/compilation_cache/cache_hits"  # the event JAX records when the persistent cache serves a compile


@dataclasses.dataclass(frozen=True)
class CompileTime:
    """Seconds one function's compile took in each stage; `cached`: XLA's part served by the persistent cache;
    `loaded`: the whole executable served by the executable cache (`compile`: the load)."""

    name: str
    trace: float
    lower: float
    compile: float
    cached: bool
    loaded: bool = False


def compile_timed(name: str, fn, *args) -> tuple[jax.stages.Compiled, CompileTime]:
    """`fn` (a jit) traced, lowered and compiled for `args` (arrays or ShapeDtypeStructs), each stage timed."""
    hits = []

    def listen(event: str, **kwargs) -> None:
        if event == CACHE_HITS:
            hits.append(event)

    jax.monitoring.register_event_listener(listen)
    try:
        began = time.perf_counter()
        traced = fn.trace(*args)
        traced_at = time.perf_counter()
        lowered = traced.lower()
        lowered_at = time.perf_counter()
        compiled = lowered.compile()
        done = time.perf_counter()
    finally:
        jax.monitoring.unregister_event_listener(listen)
    return compiled, CompileTime(name, traced_at - began, lowered_at - traced_at, done - lowered_at, bool(hits))


def summary(times: list[CompileTime]) -> str:
    """"trace 20 s, lower 30 s, compile 41 s; 1 of 2 compiles from the cache, 0 of 2 from the executable cache"
    summed over `times` ("" if none)."""
    if not times:
        return ""
    total = lambda stage: sum(getattr(t, stage) for t in times)  # noqa: E731
    return (f"trace {total('trace'):.0f} s, lower {total('lower'):.0f} s, compile {total('compile'):.0f} s; "
            f"{sum(t.cached for t in times)} of {len(times)} compiles from the cache, "
            f"{sum(t.loaded for t in times)} of {len(times)} from the executable cache")
