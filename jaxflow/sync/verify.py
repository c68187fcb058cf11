"""Sync verification: after each LoRA sync every engine says what it now serves, read back from its own memory
(jaxflow_bridge/contract/served.py: the policy version, the bound-module count and the served deltas of the adapted
weights at a probe of modules and positions fixed by name, shape and version), and the trainer compares that with
the deltas the adapter it sent gives at the same probe.

The expected deltas come from the trainer's LoRA: only the probed modules' A and B are gathered to the host
(`peft_probe`: their probed rows and columns, in one jitted program compiled once, then one host copy), so the check
costs the same at any adapter size. `LoRASync.serve` logs a mismatch as one line and syncs the same version again;
a second mismatch stops the run with `SyncMismatch` (one line naming the engine, the version and the modules that
differ). An engine whose reply carries no probe fails the check too; `train.sync_verify=False` turns it off.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jaxflow.nn.lora import LoRASpec, peft_modules, peft_probe
from jaxflow_bridge.contract.lora_payload import LoRAPayload
from jaxflow_bridge.contract.served import ServedProbe, differing, expected, probe_modules, probe_positions

SHOWN = 5  # differing modules a line names


class SyncMismatch(RuntimeError):
    """An engine does not serve the LoRA the trainer sent, also after a re-sync (one line)."""


@dataclasses.dataclass(frozen=True)
class Expected:
    """What every engine must report for `version`: `modules` bound, and `deltas` {probed module: values}."""

    version: int
    modules: int
    deltas: dict[str, np.ndarray]


def expected_of(lora, spec: LoRASpec, version: int) -> Expected:
    """The probe of `version` for `lora` (the LoRA state sent, device or host arrays), in float64."""
    names = peft_modules(lora, spec)
    probed = probe_modules(names, version)
    scale = LoRAPayload(version, spec.peft_config(), tensors={}).scale
    deltas = {}
    wanted = set(probed)
    factors = peft_probe(lora, spec, lambda m, shape: probe_positions(m, shape) if m in wanted else None)
    for module, (a_cols, b_rows) in factors.items():  # A[:, cols] (r, k), B[rows] (k, r)
        k = np.arange(b_rows.shape[0])
        deltas[module] = expected(a_cols, b_rows, scale, k, k)
    return Expected(int(version), len(names), deltas)


def engine_problem(ack: dict, want: Expected) -> str | None:
    """What is wrong with one engine's reply to the sync of `want.version` (None: it serves what was sent)."""
    if "served" not in ack:
        return "its reply carries no served probe (an engine that cannot verify; train.sync_verify=False skips it)"
    served = ServedProbe.from_dict(ack["served"])
    problems = []
    if served.version != want.version:
        problems.append(f"it serves version {served.version}")
    if served.bound_modules != want.modules:
        problems.append(f"it binds {served.bound_modules} of the adapter's {want.modules} modules")
    bad = differing(want.deltas, served)
    if bad:
        more = f" (+{len(bad) - SHOWN} more)" if len(bad) > SHOWN else ""
        problems.append(f"{len(bad)} of {len(want.deltas)} probed modules differ: {', '.join(bad[:SHOWN])}{more}")
    return "; ".join(problems) or None


def mismatch(acks: list[dict], want: Expected, engine: str) -> str | None:
    """One line on the first engine (index among `acks`, kind `engine`) that does not serve `want`, or None."""
    for index, ack in enumerate(acks):
        problem = engine_problem(ack, want)
        if problem is not None:
            return (f"LoRA sync check: {engine} engine {index} of {len(acks)} does not serve version {want.version}: "
                    f"{problem}")
    return None
