"""The engine side of the served-weights probe (contract/served.py): what a sink serves after a LoRA sync, read from
its own memory at the probe's fixed positions, with the rounding bound of its apply mode. Torch only.

`probe_targets(payload, to_engine)` picks the probed modules (PEFT names, as the payload names them) and their
positions, and gathers the payload's own factors there on the host (the bound's magnitudes). A sink then reads, per
module, either its LoRA factors (`layers_probe`: one gather of B's rows and A's columns on the weights' device, the
product in float32) or its merged weight and the base copy it keeps (`merged_probe`: W[rows, cols] -
W_base[rows, cols], with W_base there and W's dtype, so the trainer predicts W's rounding: contract/served.py). Only
the probed modules are read, a few dozen values each; one device-to-host copy in all.

The bounds count one rounding of each factor wherever the engine's dtype or the payload's is coarser than float32:
the trainer's LoRA is float32, and a payload in bf16 was cast from it (the shared file), so the engine's factors
are not the trainer's even where the engine keeps the payload's dtype.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from jaxflow_bridge.contract.lora import lora_module, lora_pairs
from jaxflow_bridge.contract.lora_payload import LoRAPayload
from jaxflow_bridge.contract.served import (UNIT_ROUNDOFF, ServedProbe, merged_error, probe_modules, probe_positions,
                                            product_tolerance)
from jaxflow_bridge.rollout.tensors import torch_to_numpy

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclasses.dataclass(frozen=True)
class Target:
    """One probed module: its PEFT name, its name on the engine, its positions and the payload's factors there
    (a (r, k) = A[:, cols], b (k, r) = B[rows], float64, unscaled), and the payload's dtypes."""

    module: str
    engine: str
    rows: np.ndarray
    cols: np.ndarray
    a: np.ndarray
    b: np.ndarray
    dtypes: tuple[str, ...]

    def roundoff(self, stored: str) -> float:
        """The unit roundoff of the one rounding the engine's factors, held in dtype `stored`, may have had on their
        way from the trainer's float32 values (or a wider payload's): the coarser of `stored` and the payload's
        dtypes; 0.0 where both are float32 (held exactly)."""
        coarsest = max(UNIT_ROUNDOFF.get(d, 0.0) for d in (stored, *self.dtypes))
        wider = any(d not in UNIT_ROUNDOFF for d in self.dtypes)  # float64: rounded even into float32
        return coarsest if coarsest > UNIT_ROUNDOFF["float32"] or wider else 0.0


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
        dtypes = tuple(sorted({str(x.dtype).removeprefix("torch.") for x in (a, b)}))
        out.append(Target(m, renamed[m], rows, cols, _host(a, cols=cols), _host(b, rows=rows), dtypes))
    return out


def _magnitude(t: Target, scale: float) -> np.ndarray:
    return abs(scale) * np.einsum("kr,rk->k", np.abs(t.b), np.abs(t.a))


def layers_probe(payload: LoRAPayload, targets: list[Target], factors: Callable[[str], tuple | None],
                 bound: int) -> ServedProbe:
    """The served deltas of LoRA layers: `factors(engine module)` -> (A (r, in), B (out, r), scale) as the engine
    holds them, or None where nothing is bound (zeros served). The bound: `product_tolerance` of the payload's
    factors, each rounded once (`Target.roundoff`)."""
    deltas, tolerances, found = {}, {}, {}
    for t in targets:
        held = factors(t.engine)
        if held is None:
            deltas[t.module] = np.zeros(len(t.rows))
            tolerances[t.module] = product_tolerance(t.a, t.b, payload.scale, *_diag(t), 0.0)
            continue
        a, b, scale = held
        rows, cols = (torch.from_numpy(i).to(a.device) for i in (t.rows, t.cols))
        found[t.module] = scale * (b[rows].float() * a[:, cols].float().T).sum(1)
        tolerances[t.module] = product_tolerance(t.a, t.b, payload.scale, *_diag(t), t.roundoff(DTYPES[a.dtype]))
    deltas.update(_to_host(found))
    return ServedProbe(payload.version, bound, deltas, tolerances)


def merged_probe(payload: LoRAPayload, targets: list[Target], weights: Callable[[str], tuple | None],
                 bound: int) -> ServedProbe:
    """The served deltas of merged weights: `weights(engine module)` -> (W, W_base, first row) with W the
    adapted weight on its device and W_base its exact base copy (host), or None where nothing is merged (zeros
    served, bounded as unbound layers are); with W_base at the positions and W's dtype, and as the bound
    `merged_error`: the error of W_base + delta before W's rounding, each factor rounded once (`Target.roundoff`)."""
    deltas, tolerances, served, bases, dtypes = {}, {}, {}, {}, {}
    for t in targets:
        held = weights(t.engine)
        if held is None:
            deltas[t.module] = np.zeros(len(t.rows))
            tolerances[t.module] = product_tolerance(t.a, t.b, payload.scale, *_diag(t), 0.0)
            continue
        w, w_base, row = held
        rows, cols = torch.from_numpy(t.rows + row), torch.from_numpy(t.cols)
        served[t.module] = w[rows.to(w.device), cols.to(w.device)].float()
        bases[t.module] = w_base[rows.to(w_base.device), cols.to(w_base.device)].double().cpu().numpy()
        dtypes[t.module] = DTYPES[w.dtype]
    for m, w in _to_host(served).items():
        t = next(t for t in targets if t.module == m)
        deltas[m] = w - bases[m]
        tolerances[m] = merged_error(bases[m], _magnitude(t, payload.scale), t.a.shape[0], t.roundoff(dtypes[m]))
    return ServedProbe(payload.version, bound, deltas, tolerances, bases, dtypes)


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
