"""Where a rollout engine's start went, as the engine measured it in its own process and reports it in `info()`
(key "start", plain floats: it crosses Ray); the trainer's start-up line names the parts (jaxflow/train.py)."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True)
class EngineStart:
    """Seconds of an engine's start, in order: `imports` (the engine library's modules), `engine` (the library's
    engine up: its worker processes, model load and warm-up), `checks` (the engine's own calls to its workers after
    that: layer table, fingerprint), `warmup` (our warm-up request, where the run sends one: the server's
    `RolloutServer.warmup_s`; 0 without)."""

    imports: float
    engine: float
    checks: float
    warmup: float = 0.0

    @classmethod
    def from_stamps(cls, entry: float, imported: float, started: float, checked: float) -> EngineStart:
        """From four monotonic stamps taken in one process."""
        return cls(imported - entry, started - imported, checked - started)

    @classmethod
    def from_dict(cls, d: dict) -> EngineStart:
        return cls(**{f.name: float(d[f.name]) for f in dataclasses.fields(cls)
                      if f.name in d or f.default is dataclasses.MISSING})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def total(self) -> float:
        return self.imports + self.engine + self.checks + self.warmup

    def summary(self) -> str:
        """"imports 9 s, engine 47 s, checks 3 s" (", warm-up 40 s" where one ran)."""
        return ", ".join(f"{name.replace('warmup', 'warm-up')} {sec:.0f} s" for name, sec in self.to_dict().items()
                         if sec or name != "warmup")


def slowest_start(infos: Iterable[dict]) -> EngineStart | None:
    """The longest start among engines' `info()` (they load side by side; the trainer waits for the last), None
    where none reports one."""
    starts = [EngineStart.from_dict(info["start"]) for info in infos if info.get("start")]
    return max(starts, key=lambda s: s.total, default=None)
