"""The engine side of the served-weights probe (contract/served.py): what a sink serves after a LoRA sync, read from
its own memory at the probe's fixed positions, with the rounding bound of its apply mode. Torch only.

`probe_targets(payload, to_engine)` picks the probed modules (PEFT names, as the payload names them) and their
positions, and gathers the payload's own factors there on the host (the bound's magnitudes). A sink then reads, per
module, either its LoRA factors (`layers_probe`: one gather of B's rows and A's columns on the weights' device, the
product in float32) or its merged weight and the base copy it keeps (`merged_probe`: W[rows, cols] - W_base[rows, cols]).
Only the probed modules are read, a few dozen values each; one device-to-host copy in all.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from jaxflow_bridge.contract.lora import lora_module, lora_pairs
from jaxflow_bridge.contract.lora_payload import LoRAPayload
from jaxflow_bridge.contract.served import (UNIT_ROUNDOFF, ServedProbe, merged_tolerance, probe_modules,
                                            probe_positions, product_tolerance)
from jaxflow_bridge.rollout.tensors import torch_to_numpy

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclasses.dataclass(frozen=True)
class Target:
    """One probed module: its PEFT name, its name on the engine, its positions and the payload's factors there
    (a (r, k) = A[:, cols], b (k, r) = B[rows], float64, unscaled), and whether the payload held them exactly in
    a float format of at most 32 bits."""

    module: str
    engine: str
    rows: np.ndarray
    cols: np.ndarray
    a: np.ndarray
    b: np.ndarray
    dtype: str

    def rounded(self, stored: str) -> bool:
        """Whether storing the payload's factors in dtype `stored` may round them."""
        return self.dtype != stored and not (stored == "float32" and self.dtype in UNIT_ROUNDOFF)


def _host(x, rows=None, cols=None) -> np.ndarray:
    """x[rows] or x[:, cols] as a float64 host array (x numpy, or a torch tensor on any device: gathered there)."""
    if isinstance(x, np.ndarray):
        return np.asarray(x[rows] if cols is None else x[:, cols], np.float64)
    index = torch.from_numpy(rows if cols is None else cols).to(x.device)
    return np.asarray(torch_to_numpy(x.index_select(0 if cols is None else 1, index)), np.float64)


def engine_names(adapter: Callable[[dict], dict] | None, modules) -> dict[str, str]:
    """{PEFT module: the engine's name for it} under `adapter` (tensors -> tensors renamed, as the engine applies
    adapters; None: the same names)."""
    if adapter is None:
        return {m: m for m in modules}
    return {m: lora_module(next(iter(adapter({f"{m}.lora_A.weight": None})))) for m in modules}


def probe_targets(payload: LoRAPayload, adapter: Callable[[dict], dict] | None = None) -> list[Target]:
    """The probed modules of `payload` at its version, with positions and the payload's factors there."""
    pairs = lora_pairs(payload.arrays())
    names = probe_modules(pairs, payload.version)
    renamed = engine_names(adapter, names)
    out = []
    for m in names:
        a, b = pairs[m]
        rows, cols = probe_positions(m, (b.shape[0], a.shape[1]))
        dtypes = {str(x.dtype).removeprefix("torch.") for x in (a, b)}
        dtype = dtypes.pop() if len(dtypes) == 1 else "mixed"
        out.append(Target(m, renamed[m], rows, cols, _host(a, cols=cols), _host(b, rows=rows), dtype))
    return out


def _magnitude(t: Target, scale: float) -> np.ndarray:
    return abs(scale) * np.einsum("kr,rk->k", np.abs(t.b), np.abs(t.a))


def layers_probe(payload: LoRAPayload, targets: list[Target], factors: Callable[[str], tuple | None],
                 bound: int) -> ServedProbe:
    """The served deltas of LoRA layers: `factors(engine module)` -> (A (r, in), B (out, r), scale) as the engine
    holds them, or None where nothing is bound (zeros served). The bound: `product_tolerance` of the payload's
    factors, rounded once into the layers' dtype unless both are float32."""
    deltas, tolerances, found = {}, {}, {}
    for t in targets:
        held = factors(t.engine)
        if held is None:
            deltas[t.module] = np.zeros(len(t.rows))
            tolerances[t.module] = product_tolerance(t.a, t.b, payload.scale, *_diag(t), "float32", False)
            continue
        a, b, scale = held
        rows, cols = (torch.from_numpy(i).to(a.device) for i in (t.rows, t.cols))
        found[t.module] = scale * (b[rows].float() * a[:, cols].float().T).sum(1)
        stored = DTYPES[a.dtype]
        tolerances[t.module] = product_tolerance(t.a, t.b, payload.scale, *_diag(t), stored, t.rounded(stored))
    deltas.update(_to_host(found))
    return ServedProbe(payload.version, bound, deltas, tolerances)


def merged_probe(payload: LoRAPayload, targets: list[Target], weights: Callable[[str], tuple | None],
                 bound: int) -> ServedProbe:
    """The served deltas of merged weights: `weights(engine module)` -> (W, W_base, first row) with W the
    adapted weight on its device and W_base its exact base copy (host), or None where nothing is merged (zeros
    served); the bound: `merged_tolerance` in W's dtype, plus each factor's rounding into it where the sink cast
    the payload to W's dtype before merging (arrays in float32 into bf16 weights)."""
    deltas, tolerances, served, base, stored = {}, {}, {}, {}, {}
    for t in targets:
        held = weights(t.engine)
        if held is None:
            deltas[t.module] = np.zeros(len(t.rows))
            tolerances[t.module] = merged_tolerance(np.zeros(len(t.rows)), "float32", _magnitude(t, payload.scale))
            continue
        w, w_base, row = held
        rows, cols = torch.from_numpy(t.rows + row), torch.from_numpy(t.cols)
        served[t.module] = w[rows.to(w.device), cols.to(w.device)].float()
        base[t.module] = w_base[rows.to(w_base.device), cols.to(w_base.device)].double().cpu().numpy()
        stored[t.module] = DTYPES[w.dtype]
    for m, w in _to_host(served).items():
        t = next(t for t in targets if t.module == m)
        deltas[m] = w - base[m]
        magnitude = _magnitude(t, payload.scale)
        cast = 2 * UNIT_ROUNDOFF[stored[m]] * magnitude if t.rounded(stored[m]) else 0.0
        tolerances[m] = merged_tolerance(w, stored[m], magnitude) + cast
    return ServedProbe(payload.version, bound, deltas, tolerances)


def _diag(t: Target) -> tuple[np.ndarray, np.ndarray]:
    """Positions into a target's gathered factors (b (k, r) row i pairs with a (r, k) column i)."""
    k = np.arange(len(t.rows))
    return k, k


def _to_host(values: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """{module: float64 host values} of per-module device vectors, in one copy."""
    if not values:
        return {}
    flat = torch.cat(list(values.values())).double().cpu().numpy()
    out, start = {}, 0
    for m, v in values.items():
        out[m], start = flat[start:start + len(v)], start + len(v)
    return out
