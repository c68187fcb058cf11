"""Ahead-of-time compiles timed by stage, for the start-up line's memory plan: tracing and lowering (Python's work,
redone at every start: the persistent compilation cache is keyed by the lowered program; they hold the GIL, so they
run one after the other) and XLA's compile (on a warm start served by that cache,
`jaxflow.config.machine.compilation_cache`), which releases the GIL: `compile_lowered` runs in a thread of its own,
so that the step's programs compile at once (`jaxflow.trainer.train_step.TrainStep.compile`). A compile the executable
cache serves (`jaxflow.trainer.executable_cache`) shows as trace 0, lower 0 and its load's seconds.

A compile that neither cache serves is not always cold: beside its persistent cache JAX keeps XLA's per-fusion
autotune cache (`jax_persistent_cache_enable_xla_caches`, on by default), read by every compile whatever its program,
so the GEMMs and fusions an earlier run tuned are not tuned again (a program that differs in its loss alone shares
every block's); `autotune_results` counts what it held, which the summary names."""
from __future__ import annotations

import dataclasses
import functools
import threading
import time
from pathlib import Path

import jax

AUTOTUNE_CACHE = "xla_gpu_per_fusion_autotune_cache_dir"  # JAX's folder for XLA's autotune cache, in its cache's
CACHE_HITS = "/jax/compilation_cache/cache_hits"  # the event JAX records when the persistent cache serves a compile
_hit = threading.local()  # `hit`: the persistent cache served a compile in this thread (set by `_listen`)


@dataclasses.dataclass(frozen=True)
class CompileTime:
    """Seconds one function's compile took in each stage; `cached`: XLA's part served by the persistent cache;
    `loaded`: the whole executable served by the executable cache (`load`: its seconds, `compile` 0). `span`:
    (start, end) of its compile or load on `time.perf_counter`'s clock, so that `summary` counts compiles that ran
    at once by their wall time (None: counted alone)."""

    name: str
    trace: float
    lower: float
    compile: float
    cached: bool
    loaded: bool = False
    load: float = 0.0
    span: tuple[float, float] | None = None


@dataclasses.dataclass(frozen=True)
class Lowered:
    """A function traced and lowered (`lower_timed`), to be compiled (`compile_lowered`)."""

    name: str
    lowered: jax.stages.Lowered
    trace: float
    lower: float


def lower_timed(name: str, fn, *args) -> Lowered:
    """`fn` (a jit) traced and lowered for `args` (arrays or ShapeDtypeStructs), each stage timed."""
    began = time.perf_counter()
    traced = fn.trace(*args)
    traced_at = time.perf_counter()
    lowered = traced.lower()
    return Lowered(name, lowered, traced_at - began, time.perf_counter() - traced_at)


def compile_lowered(lowered: Lowered) -> tuple[jax.stages.Compiled, CompileTime]:
    """XLA's compile of `lowered`, timed; safe to run in several threads at once (the persistent cache's hit is
    told apart by thread)."""
    _listening()
    _hit.hit = False
    began = time.perf_counter()
    compiled = lowered.lowered.compile()
    done = time.perf_counter()
    return compiled, CompileTime(lowered.name, lowered.trace, lowered.lower, done - began, _hit.hit,
                                 span=(began, done))


@functools.cache
def _listening() -> None:
    """Listen for the persistent cache's hits from now on (once a process)."""
    jax.monitoring.register_event_listener(_listen)


def _listen(event: str, **kwargs) -> None:
    if event == CACHE_HITS:  # recorded in the thread that compiles
        _hit.hit = True


def wall(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of `spans` ((start, end) pairs)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _seconds(times: list[CompileTime], stage: str) -> float:
    """The wall time of `times`' `stage` ("compile", or "load" for those the executable cache served): the union
    of their spans, plus the seconds of those without one."""
    did = [t for t in times if t.loaded == (stage == "load")]
    return (wall([t.span for t in did if t.span is not None])
            + sum(getattr(t, stage) for t in did if t.span is None))


def autotune_results() -> int | None:
    """The results XLA's per-fusion autotune cache holds now (one file each), where JAX's persistent cache keeps one
    (its folder `AUTOTUNE_CACHE`); None where it keeps none (the cache or that option off)."""
    enabled = jax.config.jax_persistent_cache_enable_xla_caches or ""
    folder = jax.config.jax_compilation_cache_dir
    if not (jax.config.jax_enable_compilation_cache and folder and (enabled == "all" or AUTOTUNE_CACHE in enabled)):
        return None
    tuned = Path(folder) / AUTOTUNE_CACHE
    return sum(1 for f in tuned.rglob("*") if f.is_file()) if tuned.is_dir() else 0


def summary(times: list[CompileTime], autotuned: int | None = None) -> str:
    """"trace 20 s, lower 30 s, compile 41 s; 1 of 2 compiles from the cache, 0 of 2 from the executable cache"
    over `times` ("" if none): tracing and lowering summed (they run one after the other), XLA's compile as the
    wall time of those that ran at once, and the executable cache's loads as "load N s" where there were any; with
    `autotuned` (`autotune_results` before the compiles) ", XLA's autotune cache held N results": 0 where the
    compiles were cold."""
    if not times:
        return ""
    held = "" if autotuned is None else f", XLA's autotune cache held {autotuned} results"
    total = lambda stage: sum(getattr(t, stage) for t in times)  # noqa: E731
    load = f", load {_seconds(times, 'load'):.0f} s" if any(t.loaded for t in times) else ""
    return (f"trace {total('trace'):.0f} s, lower {total('lower'):.0f} s, compile {_seconds(times, 'compile'):.0f} s"
            f"{load}; {sum(t.cached for t in times)} of {len(times)} compiles from the cache, "
            f"{sum(t.loaded for t in times)} of {len(times)} from the executable cache{held}")
