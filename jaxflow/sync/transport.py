"""How each LoRA version travels to the rollout engines: one transport, chosen once at start from the placement and
printed once (with the engines' apply mode), never switched at sync time.

- "device": the engine in the trainer's process on a device JAX addresses: DLPack views (`lora_sync`);
- "shm": engines on this host: one shared-memory file (`lora_sync.SharedLoRA`), only its manifest crosses Ray;
- "ray": engines on another host (or an in-process engine JAX cannot reach): host numpy arrays.

A sync that fails says so: one logged line, counted in `failures` (the step metric `sync_failures`), retried once;
a second failure stops the run with one line naming the engine, the transport and the version. A refused adapter
(ValueError: bad shapes or values) is counted and re-raised at once: resending it cannot help.

Every sync is then checked (`jaxflow/sync/verify.py`, `train.sync_verify`): each engine's reply says what it serves,
read from its own memory; a mismatch is logged, counted in `mismatches` and the version sent again, once; a second
stops the run (`SyncMismatch`). The check's own time is `verify_s` (the step metric `sync_verify_s`).
`stale_from` is fault injection (`train.sync_fault_from`, for tests and jaxflow_bench.trust): from that version on
the engines are sent the previous version's LoRA while the check expects the new one, as a stale engine would serve.
"""
from __future__ import annotations

import logging
import socket
import time

import jax

from jaxflow.nn.lora import LoRASpec, lora_to_peft
from jaxflow.sync.lora_sync import SharedLoRA, device_peft_tensors, device_target
from jaxflow.sync.verify import SyncMismatch, expected_of, mismatch
from jaxflow.trainer import phases

log = logging.getLogger(__name__)


def choose_transport(in_process: bool, processes: int, infos: list[dict]) -> str:
    """The transport for engines described by `infos` (their `info()`, with the server's "host")."""
    if in_process:
        return "device" if processes == 1 and device_target(infos[0]) is not None else "ray"
    return "shm" if all(i.get("host") == socket.gethostname() for i in infos) else "ray"


class LoRASync:
    """Serves the train state's LoRA to `rollout` (a RolloutGroup) through the transport chosen at start."""

    def __init__(self, rollout, spec: LoRASpec, transport: str, info: dict, verify: bool = True,
                 stale_from: int = 0):
        self.rollout, self.spec, self.transport = rollout, spec, transport
        self.engine, self.failures, self.mismatches = info["engine"], 0, 0
        self.verify, self.stale_from, self.verify_s, self._sent = verify, stale_from, None, None
        self.target = device_target(info) if transport == "device" else None
        self.shared = SharedLoRA(spec, info["dtype"]) if transport == "shm" else None
        # one line at start on process 0, beside the start-up lines (warnings-only logging would hide it)
        print(f"LoRA sync: transport={transport}, apply={info['lora_apply']}, engine={self.engine}",
              flush=True)

    def serve(self, lora, version: int) -> int:
        """The rollout serves `lora` as policy `version`, checked; the bound-module count. Through shared memory
        the phases are sync_write (the trainer's) and sync_engine (the engine's, from its ack)."""
        sent = self._faulty(lora, version)
        bound = self._deliver(sent, version)
        if not self.verify:
            return bound
        began = time.perf_counter()
        want = expected_of(lora, self.spec, version)
        line = mismatch(self.rollout.last_acks, want, self.engine)
        self.verify_s = time.perf_counter() - began
        if line is None:
            return bound
        self.mismatches += 1
        log.error("%s; syncing version %d again", line, version)
        bound = self._deliver(sent, version)
        began = time.perf_counter()
        line = mismatch(self.rollout.last_acks, want, self.engine)
        self.verify_s += time.perf_counter() - began
        if line is not None:
            self.mismatches += 1
            raise SyncMismatch(f"{line}, also after a re-sync: the engine does not apply the LoRA the trainer "
                               f"sends (train.sync_verify=False turns the check off)")
        return bound

    def _faulty(self, lora, version: int):
        """What is sent for `version`: `lora`, or with `stale_from` the previous version's, kept as a host copy (the
        next train step donates the state's arrays, and a device copy would take the update's memory) from the
        version before `stale_from` on."""
        if not self.stale_from:
            return lora
        previous, self._sent = self._sent, (jax.device_get(lora) if version + 1 >= self.stale_from else None)
        return previous if version >= self.stale_from and previous is not None else lora

    def _deliver(self, lora, version: int) -> int:
        """One sync through the transport, retried once on failure."""
        for attempt in (1, 2):
            try:
                return self._send(lora, version)
            except Exception as exc:  # counted and reported, then retried once or raised
                self.failures += 1
                line = (f"LoRA sync of version {version} to the {self.engine} engine through {self.transport} "
                        f"failed{' again' if attempt == 2 else ''}: {type(exc).__name__}: {exc}")
                log.error(line)
                if isinstance(exc, ValueError):
                    raise
                if attempt == 2:
                    raise RuntimeError(line) from exc

    def _send(self, lora, version: int) -> int:
        config = self.spec.peft_config()
        if self.shared is not None:
            with phases.phase("sync_write"):
                manifest = self.shared.write(lora)
            bound = self.rollout.update_lora_shared(manifest, version, config)
            if "seconds" in self.rollout.last_ack:
                phases.add("sync_engine", self.rollout.last_ack["seconds"])
            return bound
        tensors = (device_peft_tensors(lora, self.spec, self.target) if self.target is not None
                   else lora_to_peft(lora, self.spec))
        return self.rollout.update_lora(tensors, version, config)

    def summary(self, seconds: dict[str, float]) -> str:
        """One sync's parts for the start-up line, from its recorded phases `seconds`: "write 1 s, engines 11 s,
        check 0 s" (the trainer's write to shared memory, the engines' apply from their acks, the served-weight
        check); '' for a transport that times no parts."""
        parts = [(label, seconds[name]) for label, name in (("write", "sync_write"), ("engines", "sync_engine"))
                 if name in seconds]
        if parts and self.verify_s is not None:
            parts.append(("check", self.verify_s))
        return ", ".join(f"{label} {sec:.0f} s" for label, sec in parts)

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()
