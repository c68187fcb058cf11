"""The trainer's side of the rollout: RolloutServers behind one of two transports (`RayTransport`: actors;
`LocalTransport`: one server in this process), chunked generation that feeds the reward pool as chunks finish, LoRA
sync with acked versions, restart-and-retry when an actor dies mid-run; an engine out of memory (`EngineOutOfMemory`)
and an engine whose actor died in its creation at start-up (`EngineDidNotStart`) are never retried."""
from __future__ import annotations

import logging
import re

import numpy as np

from jaxflow_bridge.contract.trajectory import TextLengthError, TrajectoryBatch
from jaxflow_bridge.rollout.server import RolloutServer, create_rollout_server

log = logging.getLogger(__name__)
# an engine's out-of-memory error as text (it reaches the trainer in Ray's RayTaskError, or an actor that died of it):
# torch's "CUDA out of memory" (torch.OutOfMemoryError), vLLM's cache that found no room, Ray's memory monitor
OOM_MARKERS = ("out of memory", "outofmemoryerror", "no available memory for the cache blocks")


class EngineOutOfMemory(RuntimeError):
    """A rollout engine ran out of memory: its own error line. Not retried: a fresh engine with the same settings
    runs out again."""


class EngineDidNotStart(RuntimeError):
    """A rollout engine's actor died in its creation (its constructor raised) before the run's first call to it
    returned: the engine's name and device and its error's last line. Not retried: the same folder, memory and config
    fail the same way."""


class RolloutDied(RuntimeError):
    """A rollout actor died on every retry of a call; the message names the last death's cause."""


def cause_line(exc: BaseException) -> str:
    """The last line of `exc`'s message (Ray's carries the remote traceback, whose last line is the error itself),
    without terminal colours, at most 240 characters."""
    lines = [ln.strip() for ln in re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).splitlines() if ln.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:240]


def died_in_creation(exc: BaseException) -> bool:
    """Whether `exc` is Ray's error for an actor that died in its creation task (its constructor raised: Ray's
    `RayActorError.actor_init_failed`), not one that died later (a killed or crashed process)."""
    return bool(getattr(exc, "actor_init_failed", False))


def engine_out_of_memory(exc: BaseException) -> str | None:
    """The line of `exc` (with its remote traceback, if any) that says an engine ran out of memory, or None."""
    lines = f"{type(exc).__name__}: {exc}".splitlines()
    found = [ln.strip() for ln in lines if any(m in ln.lower() for m in OOM_MARKERS)]
    return found[-1][:240] if found else None  # the last: a traceback ends with the error's own line


def init_ray(address: str = "", verbose: bool = False) -> None:
    """Join the Ray cluster at `address`, or start a local one (no dashboard; actors' output stays in Ray's log
    folder) whose processes all end within seconds of this one, also when it is killed (`orphan_reaper`). Starting
    Ray forks: call it before JAX starts its threads (JAX warns that a fork may deadlock)."""
    import ray
    if not ray.is_initialized():
        # "local": a new local instance even where `ray start` left a cluster's address behind
        ray.init(address=address or "local", include_dashboard=False, log_to_driver=False,
                 logging_level=logging.INFO if verbose else logging.WARNING)
        if not address:
            from jaxflow.run import orphan_reaper
            orphan_reaper.start()


class LocalTransport:
    """One RolloutServer in the trainer's process: a call returns its result. For one GPU without Ray, and for
    debugging; the engine shares the trainer's GPU and takes device tensors (DLPack) for the LoRA."""

    max_servers, device_tensors = 1, True

    def start(self, config: dict) -> RolloutServer:
        return RolloutServer(config)

    def submit(self, server, method: str, *args):
        return getattr(server, method)(*args)

    def get(self, refs):
        return refs

    def first_done(self, refs: list) -> int:
        return 0

    def retrying(self, fn, restart, started: bool = True):
        return fn()

    def kill(self, server) -> None:
        pass


class RayTransport:
    """RolloutServer actors: a call returns a Ray ref; a call on which an actor dies is retried on fresh actors
    (`restart`), up to `max_retries` times, unless it died in its creation before the group `started`; LoRA arrives
    as host arrays."""

    max_servers, device_tensors = None, False

    def __init__(self, num_cpus: float = 1, num_gpus: float = 0, max_retries: int = 2):
        self.resources, self.max_retries = {"num_cpus": num_cpus, "num_gpus": num_gpus}, max_retries

    def start(self, config: dict):
        return create_rollout_server(config, **self.resources)

    def submit(self, server, method: str, *args):
        return getattr(server, method).remote(*args)

    def get(self, refs):
        """The refs' results; an engine's TextLengthError (input to fix, not a failure) as itself, out of Ray's
        RayTaskError."""
        import ray
        try:
            return ray.get(refs)
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, TextLengthError):
                raise e.cause from None
            raise

    def first_done(self, refs: list) -> int:
        import ray
        done, _ = ray.wait(refs, num_returns=1)
        return next(i for i, ref in enumerate(refs) if ref == done[0])

    def retrying(self, fn, restart, started: bool = True):
        """`fn()`, restarting the actors (`restart`) and calling it again when one died; an engine out of memory, or
        one whose actor died in its creation before the group `started` (served a call), is raised at once."""
        import ray
        for attempt in range(self.max_retries + 1):
            try:
                return fn()
            except ray.exceptions.RayActorError as e:
                if engine_out_of_memory(e) or (not started and died_in_creation(e)):  # RolloutGroup says so, once
                    raise
                if attempt == self.max_retries:
                    raise RolloutDied(f"the rollout actor died {attempt + 1} times; giving up: the last time: "
                                      f"{cause_line(e)}") from e
                log.warning("rollout actor died (%s); restarting and retrying (%d of %d)", cause_line(e),
                            attempt + 1, self.max_retries)
                restart()

    def kill(self, server) -> None:
        import ray
        ray.kill(server, no_restart=True)


class RolloutGroup:
    """`num_servers` servers with one engine config behind a `transport` (RayTransport or LocalTransport); every
    call is retried on fresh servers if one dies (Ray), and ends in `EngineOutOfMemory` if an engine ran out of
    memory, in `EngineDidNotStart` if an actor died in its creation before any call returned (`started`)."""

    def __init__(self, engine_config: dict, num_servers: int = 1, transport=None):
        self.engine_config, self.transport = dict(engine_config), transport or RayTransport()
        count = min(num_servers, self.transport.max_servers or num_servers)
        self.servers = [self.transport.start(self.engine_config) for _ in range(count)]
        self.adapter = None  # (method, args) of the LoRA update currently served, re-sent after a restart
        self.last_ack = {}  # the first server's acknowledgement of the last LoRA update
        self.last_acks = []  # every server's, in server order (each with its "served" probe: jaxflow/sync/verify.py)
        self.started = False  # a call has returned: the engines started (a later death is restarted and retried)

    def _all(self, method: str, *args) -> list:
        """`method(*args)` on every server, retried on fresh servers if one dies."""
        t = self.transport
        return self._retrying(lambda: t.get([t.submit(s, method, *args) for s in self.servers]))

    def _retrying(self, fn):
        """`fn()` through the transport's retries; an engine's out-of-memory error becomes `EngineOutOfMemory`, an
        actor's death in its creation before the engines started `EngineDidNotStart`."""
        try:
            result = self.transport.retrying(fn, self._restart, self.started)
        except Exception as exc:  # noqa: BLE001 - only these two are converted; the rest as it came
            line = engine_out_of_memory(exc)
            if isinstance(exc, (EngineOutOfMemory, EngineDidNotStart)):
                raise
            if line is not None:
                raise EngineOutOfMemory(line) from exc
            if not self.started and died_in_creation(exc):
                c = self.engine_config
                raise EngineDidNotStart(f"the rollout engine did not start ({c.get('engine')} on {c.get('device')}): "
                                        f"{cause_line(exc)}") from exc
            raise
        self.started = True
        return result

    def _restart(self) -> None:
        count = len(self.servers)
        self.close()
        self.servers = [self.transport.start(self.engine_config) for _ in range(count)]
        if self.adapter is not None:
            method, args = self.adapter
            self.transport.get([self.transport.submit(s, method, *args) for s in self.servers])

    def info(self) -> list[dict]:
        return self._all("info")

    def share_base_weights(self, tensors: dict) -> list[dict]:
        """Every server serves `tensors` (torch views of the trainer's base weights) as its base, not copied; the
        servers' info(). In process only."""
        if not self.transport.device_tensors:
            raise RuntimeError("shared base weights need the engine in the trainer's process (LocalTransport)")
        return self._all("share_base_weights", tensors)

    def generate(self, prompts: list[str], n: int, sampling: dict, seeds: np.ndarray, prompts_per_call: int,
                 on_chunk=None, references: list | None = None) -> TrajectoryBatch:
        """B = len(prompts) * n samples in prompt order; chunks of `prompts_per_call` prompts go round-robin to
        the servers and `on_chunk(index, batch)` runs as each finishes (e.g. to submit rewards). A dead actor
        restarts the whole call, so no batch ever mixes policy versions. The chunks' text arrives padded to one
        length (`sampling["text_tokens"]`, at its source) and is joined as it is (`TrajectoryBatch.concat`).

        Trajectories come back as host numpy even in process (no DLPack path, by measurement of size): at the
        qwen_ocr recipe (512 images a step, 512^2, window 2) the latents (B, W+1, S, 64) float32 are 403 MB and the
        bf16 prompt embeds at most 470 MB, tens of ms through host memory against a step of minutes; and the
        batch is needed on the host anyway (rewards read the images, mini-batch ordering is numpy, multi-process runs
        broadcast host bytes, and a sleeping engine must not hold them on the GPU). `references`: an edit model's,
        one uint8 (R, H, W, 3) array per prompt, each sent once with its prompt (not once per sample of its group)."""
        return self._retrying(lambda: self._generate(prompts, n, sampling, seeds, prompts_per_call, on_chunk,
                                                     references))

    def _generate(self, prompts, n, sampling, seeds, per_call, on_chunk, references=None):
        t, pending = self.transport, []
        for c, start in enumerate(range(0, len(prompts), per_call)):
            server = self.servers[c % len(self.servers)]
            chunk_seeds = [int(s) for s in seeds[start * n:(start + per_call) * n]]
            args = (prompts[start:start + per_call], n, sampling, chunk_seeds)
            if references is not None:
                args += (references[start:start + per_call],)
            pending.append((t.submit(server, "generate", *args), c))
        chunks = {}
        while pending:
            ref, c = pending.pop(t.first_done([ref for ref, _ in pending]))
            chunks[c] = TrajectoryBatch.from_dict(t.get(ref))
            if on_chunk is not None:
                on_chunk(c, chunks[c])
        return TrajectoryBatch.concat([chunks[c] for c in sorted(chunks)])

    def update_lora(self, tensors: dict, version: int, adapter_config: dict) -> int:
        """Serve the adapter on every server; returns the bound-module count after checking every ack.

        `tensors`: {PEFT key: host numpy array} (`lora_to_peft`), for any server; or, in process only, device
        tensors the engine copies from before this returns (`lora_sync.device_peft_tensors`)."""
        if not self.transport.device_tensors and isinstance(tensors, dict):
            device = sorted(k for k, v in tensors.items() if not isinstance(v, np.ndarray))
            if device:
                raise ValueError(f"LoRA tensors for Ray actors must be host numpy arrays (lora_to_peft), got "
                                 f"{type(tensors[device[0]]).__name__} for {device[0]}; device tensors are for "
                                 "rollout.layout='in_process'")
        return self._update("update_lora", (tensors, version, adapter_config), version)

    def update_lora_shared(self, manifest: dict, version: int, adapter_config: dict) -> int:
        """`update_lora` from the shared-memory adapter file `manifest` names (`lora_sync.SharedLoRA`): only the
        manifest crosses Ray. FileNotFoundError when a server cannot read it (another host): send arrays then."""
        return self._update("update_lora_shared", (manifest, version, adapter_config), version)

    def _update(self, method: str, args: tuple, version: int) -> int:
        acks = self._all(method, *args)
        for ack in acks:
            if ack["version"] != version or ack["bound_modules"] < 1:
                raise RuntimeError(f"rollout did not take LoRA version {version}: ack {ack}")
        # every engine serves the same model; with served probes the sync check compares each with the adapter
        if len({ack["bound_modules"] for ack in acks}) > 1 and not all("served" in ack for ack in acks):
            raise RuntimeError(f"rollout engines bound different LoRA modules for version {version}: "
                               f"{[ack['bound_modules'] for ack in acks]}")
        if not self.transport.device_tensors:  # re-sent after a restart (in process it would pin device buffers)
            self.adapter = (method, args)
        self.last_ack, self.last_acks = acks[0], acks
        return acks[0]["bound_modules"]

    def close(self) -> None:
        for s in self.servers:
            self.transport.kill(s)
        self.servers = []

    def release_adapter(self) -> None:
        """The step's rollouts are over and the next LoRA update follows: engines that merged the adapter into their
        base weights start restoring them (while the trainer trains)."""
        self._all("release_adapter")

    def sleep(self) -> int:
        """Every server's engine sleeps; returns the GPU bytes they freed in all."""
        return sum(self._all("sleep"))

    def wake(self) -> None:
        self._all("wake")
