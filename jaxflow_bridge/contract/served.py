"""What an engine serves after a LoRA sync, read back from its own memory and checked against what the trainer sent.
Numpy only: the engine side fills a `ServedProbe` from its tensors, the trainer side compares it with `expected`.

The probe is a fixed sample: up to `PROBE_MODULES` of the payload's modules (a window over the sorted names that
moves with the version, so every module is read within a few syncs) and `PROBE_ELEMENTS` (row, column) positions of
each, chosen from the module's name and shape alone. At each position the engine reports the served delta of the
adapted weight, scale * (B @ A)[row, col]: from the LoRA layer it binds (layers, folder), or W - W_base (merged),
each with its own rounding bound.

Layers: a served delta is right when |served - expected| <= its tolerance. Merged: the engine also reports the base
values W_base (exact in the weight's dtype) and that dtype, and its tolerance bounds the arithmetic error of
W_base + delta before the one rounding into the dtype, so the trainer predicts the served weight itself: right when
round(W_base + expected - tolerance) <= W <= round(W_base + expected + tolerance), round-to-nearest-even into the
dtype (`round_to`). That is as sharp as the arithmetic: a merged bf16 weight whose delta is below half an ulp serves
the base value there, the check predicts that, and a stale or missing adapter differs wherever its weight rounds
differently, not only where it is off by an ulp.
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
# (significand bits with the implicit one, exponent of the least normal, of the largest) of the same dtypes
FORMATS = {"float32": (24, -126, 127), "bfloat16": (8, -126, 127), "float16": (11, -14, 15)}


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


def product_tolerance(a: np.ndarray, b: np.ndarray, scale: float, rows, cols, per_factor: float) -> np.ndarray:
    """The bound on a served scale * (B @ A)[row, col] computed in float32 from factors each rounded once with unit
    roundoff `per_factor` (0: held exactly), then r products summed."""
    a64, b64 = np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64))
    magnitude = abs(float(scale)) * np.einsum("kr,rk->k", b64[rows], a64[:, cols])
    rank = a64.shape[0]
    product = (2.0 + per_factor) * per_factor  # (1 + u) ** 2 - 1: both factors rounded
    return magnitude * (product + (rank + 2) * UNIT_ROUNDOFF["float32"]) + np.finfo(np.float32).tiny


def merged_error(base: np.ndarray, delta_magnitude: np.ndarray, rank: int, per_factor: float) -> np.ndarray:
    """The bound on W_base + scale * (B @ A) as an engine computes it before rounding into W's dtype: each factor
    rounded once with unit roundoff `per_factor` (0: held exactly), r products summed and scaled in float32, then
    added to W_base (exact) in float32."""
    magnitude = np.abs(np.asarray(delta_magnitude, np.float64))
    u32 = UNIT_ROUNDOFF["float32"]
    product = (2.0 + per_factor) * per_factor  # (1 + u) ** 2 - 1: both factors rounded
    return (magnitude * (product + (int(rank) + 2) * u32) + (np.abs(np.asarray(base, np.float64)) + magnitude) * u32
            + np.finfo(np.float32).tiny)


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """float64 `x` rounded to nearest, ties to even, into `dtype` (a key of FORMATS; subnormals and overflow to inf
    as IEEE rounds), as float64."""
    bits, least, largest = FORMATS[dtype]
    x = np.asarray(x, np.float64)
    exponent = np.frexp(x)[1]  # |x| in [2 ** (exponent - 1), 2 ** exponent)
    quantum = np.ldexp(1.0, np.maximum(exponent - 1, least) - (bits - 1))
    with np.errstate(invalid="ignore"):
        out = np.rint(x / quantum) * quantum
    top = (2.0 - 2.0 ** (1 - bits)) * 2.0 ** largest
    return np.where(np.abs(out) > top, np.copysign(np.inf, x), out)


@dataclasses.dataclass(frozen=True)
class ServedProbe:
    """An engine's answer for policy `version`: how many modules it binds, and per probed module the served deltas at
    `probe_positions` with their tolerances; for a merged module also its base values there (`bases`) and its
    weight's dtype (`dtypes`), which make its tolerance the bound before rounding (module docstring). Plain lists,
    so it crosses Ray and JSON as is."""

    version: int
    bound_modules: int
    deltas: Mapping[str, Sequence[float]]
    tolerances: Mapping[str, Sequence[float]]
    bases: Mapping[str, Sequence[float]] = dataclasses.field(default_factory=dict)
    dtypes: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"version": int(self.version), "bound_modules": int(self.bound_modules),
                "deltas": {m: [float(x) for x in v] for m, v in self.deltas.items()},
                "tolerances": {m: [float(x) for x in v] for m, v in self.tolerances.items()},
                "bases": {m: [float(x) for x in v] for m, v in self.bases.items()},
                "dtypes": {m: str(d) for m, d in self.dtypes.items()}}

    @classmethod
    def from_dict(cls, d: Mapping) -> "ServedProbe":
        return cls(int(d["version"]), int(d["bound_modules"]), dict(d["deltas"]), dict(d["tolerances"]),
                   dict(d["bases"]), dict(d["dtypes"]))


def differing(want: Mapping[str, np.ndarray], served: ServedProbe) -> list[str]:
    """The probed modules whose served values are off `want` (module: expected deltas) by more than their bound
    (module docstring), or that the engine did not report, sorted; positions whose expected value is NaN are not
    compared."""
    bad = []
    for module, values in want.items():
        got = served.deltas.get(module)
        tol = served.tolerances.get(module)
        if got is None or tol is None or len(got) != len(values) or not _within(module, values, got, tol, served):
            bad.append(module)
    return sorted(bad)


def _within(module: str, values, got, tol, served: ServedProbe) -> bool:
    exact, got, tol = (np.asarray(x, np.float64) for x in (values, got, tol))
    if module in served.bases:
        base, dtype = np.asarray(served.bases[module], np.float64), served.dtypes[module]
        weight, centre = base + got, base + exact  # base + (W - base) is W: both exact in W's dtype
        tol = tol + np.abs(centre) * 2.0 ** -52  # float64's own rounding of the sums here
        within = (round_to(centre - tol, dtype) <= weight) & (weight <= round_to(centre + tol, dtype))
    else:
        within = np.abs(got - exact) <= tol  # a NaN served is not within
    return not np.any(~within & ~np.isnan(exact))  # an expected NaN: beyond float32's range (`expected`)
