"""The trainer's side of the rollout: a group of Ray RolloutServer actors, chunked generation that feeds the
reward pool as chunks finish, LoRA sync with acked versions, and restart-and-retry when an actor dies."""
from __future__ import annotations

import logging

import numpy as np

from bridge.rollout.server import create_rollout_server
from bridge.trajectory import TrajectoryBatch

log = logging.getLogger(__name__)


class RolloutGroup:
    """`num_servers` actors with one engine config; every call is retried on a fresh actor if one dies."""

    def __init__(self, engine_config: dict, num_servers: int = 1, num_cpus: float = 1, num_gpus: float = 0,
                 max_retries: int = 2):
        self.engine_config, self.max_retries = dict(engine_config), max_retries
        self.resources = {"num_cpus": num_cpus, "num_gpus": num_gpus}
        self.servers = [create_rollout_server(self.engine_config, **self.resources) for _ in range(num_servers)]
        self.adapter = None  # (tensors, version, adapter_config) currently served

    def _call(self, fn):
        import ray
        for attempt in range(self.max_retries + 1):
            try:
                return fn()
            except ray.exceptions.RayActorError as e:
                if attempt == self.max_retries:
                    raise RuntimeError(f"rollout actor died {attempt + 1} times; giving up") from e
                log.warning("rollout actor died (%s); restarting and retrying", e)
                self._restart()

    def _restart(self) -> None:
        import ray
        for s in self.servers:
            ray.kill(s, no_restart=True)
        self.servers = [create_rollout_server(self.engine_config, **self.resources) for _ in self.servers]
        if self.adapter is not None:
            ray.get([s.update_lora.remote(*self.adapter) for s in self.servers])

    def info(self) -> list[dict]:
        import ray
        return self._call(lambda: ray.get([s.info.remote() for s in self.servers]))

    def generate(self, prompts: list[str], n: int, sampling: dict, seeds: np.ndarray, prompts_per_call: int,
                 on_chunk=None) -> TrajectoryBatch:
        """B = len(prompts) * n samples in prompt order; chunks of `prompts_per_call` prompts go round-robin to
        the servers and `on_chunk(index, batch)` runs as each finishes (e.g. to submit rewards). A dead actor
        restarts the whole call, so no batch ever mixes policy versions."""
        return self._call(lambda: self._generate(prompts, n, sampling, seeds, prompts_per_call, on_chunk))

    def _generate(self, prompts, n, sampling, seeds, per_call, on_chunk):
        import ray
        refs = {}
        for c, start in enumerate(range(0, len(prompts), per_call)):
            server = self.servers[c % len(self.servers)]
            chunk_seeds = [int(s) for s in seeds[start * n:(start + per_call) * n]]
            refs[server.generate.remote(prompts[start:start + per_call], n, sampling, chunk_seeds)] = c
        chunks, pending = {}, list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            c = refs[done[0]]
            chunks[c] = TrajectoryBatch.from_dict(ray.get(done[0]))
            if on_chunk is not None:
                on_chunk(c, chunks[c])
        return TrajectoryBatch.concat([chunks[c] for c in sorted(chunks)])

    def update_lora(self, tensors: dict, version: int, adapter_config: dict) -> int:
        """Serve the adapter on every server; returns the bound-module count after checking every ack."""
        import ray
        acks = self._call(lambda: ray.get([s.update_lora.remote(tensors, version, adapter_config)
                                           for s in self.servers]))
        for ack in acks:
            if ack["version"] != version or ack["bound_modules"] < 1:
                raise RuntimeError(f"rollout did not take LoRA version {version}: ack {ack}")
        self.adapter = (tensors, version, adapter_config)
        return acks[0]["bound_modules"]

    def close(self) -> None:
        import ray
        for s in self.servers:
            ray.kill(s, no_restart=True)
        self.servers = []

    def sleep(self) -> None:
        import ray
        self._call(lambda: ray.get([s.sleep.remote() for s in self.servers]))

    def wake(self) -> None:
        import ray
        self._call(lambda: ray.get([s.wake.remote() for s in self.servers]))
