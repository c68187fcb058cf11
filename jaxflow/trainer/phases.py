"""A step's phases timed by context: `with recording() as seconds:` around a step, `with phase("rollout"):` (or
`add("sync_engine", s)` for a time measured elsewhere) anywhere below it, in this thread, with no dict handed down.
Outside a recording a phase costs one clock read and records nothing. The metrics log them as time/<name>."""
from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator

_RECORDING: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("jaxflow_phases", default=None)


@contextlib.contextmanager
def recording() -> Iterator[dict[str, float]]:
    """Record the phases timed inside the block (this thread); yields their {name: seconds}, filled as they end.
    A recording inside another replaces it for its block."""
    seconds: dict[str, float] = {}
    token = _RECORDING.set(seconds)
    try:
        yield seconds
    finally:
        _RECORDING.reset(token)


def active() -> bool:
    """Whether a recording is on (the train step then waits for each phase's device work, to time it)."""
    return _RECORDING.get() is not None


def add(name: str, seconds: float) -> None:
    """Add `seconds` to phase `name` of the recording in force (none: nothing happens)."""
    current = _RECORDING.get()
    if current is not None:
        current[name] = current.get(name, 0.0) + seconds


def merge(seconds: dict[str, float]) -> None:
    """Add another recording's phases (e.g. one made in a worker thread) to the one in force."""
    for name, value in seconds.items():
        add(name, value)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the block as phase `name` (added when it ends normally)."""
    start = time.perf_counter()
    yield
    add(name, time.perf_counter() - start)
