"""What an engine serves after a LoRA sync, read back from its own memory and checked against what the trainer sent.
Numpy only: the engine side fills a `ServedProbe` from its tensors, the trainer side compares it with `expected`.

The probe is a fixed sample: up to `PROBE_MODULES` of the payload's modules (a window over the sorted names that
moves with the version, so every module is read within a few syncs) and `PROBE_ELEMENTS` (row, column) positions of
each, chosen from the module's name and shape alone. At each position the engine reports the served delta of the
adapted weight, scale * (B @ A)[row, col]: from the LoRA layer it binds (layers, folder), or W - W_base (merged),
each with its own rounding bound, so a served value is right when |served - expected| <= tolerance.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from collections.abc import Mapping, Sequence

import numpy as np

PROBE_MODULES = 32
PROBE_ELEMENTS = 64
# unit roundoff (half an ulp at 1) of the dtypes an engine stores weights in
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


def probe_modules(modules: Sequence[str], version: int, limit: int = PROBE_MODULES) -> list[str]:
    """The modules probed at `version`: every one when there are at most `limit`, else `limit` of the sorted names,
    evenly spaced, the window shifted by `version` so consecutive versions read different modules."""
    names = sorted(modules)
    if len(names) <= limit:
        return names
    stride = len(names) / limit
    offset = int(version) % math.ceil(stride)
    return sorted({names[(int(i * stride) + offset) % len(names)] for i in range(limit)})


def probe_positions(module: str, shape: tuple[int, int], k: int = PROBE_ELEMENTS) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) int64 (k,) of a module's (out, in) weight: fixed by its name and shape (drawn once per module,
    every sync probes some)."""
    rows, cols = _positions(module, tuple(int(s) for s in shape), int(k))
    return rows.copy(), cols.copy()


@functools.lru_cache(maxsize=4096)
def _positions(module: str, shape: tuple[int, int], k: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(zlib.crc32(module.encode()))
    return rng.integers(0, shape[0], k), rng.integers(0, shape[1], k)


def expected(a: np.ndarray, b: np.ndarray, scale: float, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """scale * (B @ A)[rows, cols] in float64 from lora_A (r, in) and lora_B (out, r); NaN where the products' sum of
    magnitudes passes float32's range, which no engine computing in float32 can serve (a diverged adapter: the
    divergence checks stop such a run), so `differing` does not compare there."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    value = float(scale) * np.einsum("kr,rk->k", b64[rows], a64[:, cols])
    magnitude = abs(float(scale)) * np.einsum("kr,rk->k", np.abs(b64[rows]), np.abs(a64[:, cols]))
    return np.where(magnitude < np.finfo(np.float32).max, value, np.nan)


def expected_probe(tensors: Mapping, scale: float, version: int) -> dict[str, np.ndarray]:
    """{probed module: expected served deltas} of a PEFT adapter (`tensors`: {PEFT key: array}) at `version`."""
    from jaxflow_bridge.contract.lora import lora_pairs

    pairs = lora_pairs(tensors)
    return {m: expected(a, b, scale, *probe_positions(m, (b.shape[0], a.shape[1])))
            for m, (a, b) in ((m, pairs[m]) for m in probe_modules(pairs, version))}


def product_tolerance(a: np.ndarray, b: np.ndarray, scale: float, rows, cols, stored: str, rounded: bool) -> np.ndarray:
    """The bound on a served scale * (B @ A)[row, col] computed in float32 from factors stored in dtype `stored`:
    each factor rounded once into it when `rounded` (the engine cast the payload), then r products summed."""
    a64, b64 = np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64))
    magnitude = abs(float(scale)) * np.einsum("kr,rk->k", b64[rows], a64[:, cols])
    per_factor = UNIT_ROUNDOFF[stored] if rounded else 0.0
    rank = a64.shape[0]
    return magnitude * (2.0 * per_factor + (rank + 2) * UNIT_ROUNDOFF["float32"]) + np.finfo(np.float32).tiny


def merged_tolerance(served_weights: np.ndarray, stored: str, delta_magnitude: np.ndarray) -> np.ndarray:
    """The bound on a served W - W_base, where W = round(W_base + delta) is stored in dtype `stored` (W_base exact):
    half an ulp of W plus the float32 rounding of the delta's computation."""
    w = np.abs(np.asarray(served_weights, np.float64))
    return (w * UNIT_ROUNDOFF[stored] + np.abs(delta_magnitude) * 4 * UNIT_ROUNDOFF["float32"]
            + np.finfo(np.float32).tiny)


@dataclasses.dataclass(frozen=True)
class ServedProbe:
    """An engine's answer for policy `version`: how many modules it binds, and per probed module the served deltas at
    `probe_positions` with their tolerances (plain lists, so it crosses Ray and JSON as is)."""

    version: int
    bound_modules: int
    deltas: Mapping[str, Sequence[float]]
    tolerances: Mapping[str, Sequence[float]]

    def to_dict(self) -> dict:
        return {"version": int(self.version), "bound_modules": int(self.bound_modules),
                "deltas": {m: [float(x) for x in v] for m, v in self.deltas.items()},
                "tolerances": {m: [float(x) for x in v] for m, v in self.tolerances.items()}}

    @classmethod
    def from_dict(cls, d: Mapping) -> "ServedProbe":
        return cls(int(d["version"]), int(d["bound_modules"]), dict(d["deltas"]), dict(d["tolerances"]))


def differing(want: Mapping[str, np.ndarray], served: ServedProbe) -> list[str]:
    """The probed modules whose served deltas are off `want` (module: expected values) by more than their
    tolerance, or that the engine did not report, sorted; positions whose expected value is NaN are not compared."""
    bad = []
    for module, values in want.items():
        got = served.deltas.get(module)
        tol = served.tolerances.get(module)
        if got is None or tol is None or len(got) != len(values):
            bad.append(module)
        else:
            exact = np.asarray(values, np.float64)
            within = np.abs(np.asarray(got, np.float64) - exact) <= np.asarray(tol)  # a NaN served is not within
            if np.any(~within & ~np.isnan(exact)):  # an expected NaN: beyond float32's range (`expected`)
                bad.append(module)
    return sorted(bad)
