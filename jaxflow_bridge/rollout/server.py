"""The Ray rollout server: one actor hosting one engine picked by `config["engine"]` from `ENGINES`.

    server = create_rollout_server({"engine": "diffusers", "model": path, "dtype": "bfloat16"}, num_gpus=1)
    batch = TrajectoryBatch.from_dict(ray.get(server.generate.remote(prompts, n, {"height": 512, ...})))
    ray.get(server.update_lora.remote(tensors, version, adapter_config))  # {"version", "bound_modules", "served"}

`ENGINES` names each engine's `RolloutEngine` subclass by import path ("package.module:Class"), so that choosing
one never imports another's dependencies. An actor runs one call at a time (Ray's default max_concurrency=1), so a
LoRA update never overlaps a generation. The diffusers engine opens no ports: any number of servers can start in
parallel. Never imports JAX.
"""

from __future__ import annotations

import importlib
import socket
import time

from jaxflow_bridge.rollout.engine import RolloutEngine

ENGINES: dict[str, str] = {
    "diffusers": "jaxflow_bridge.engines.diffusers:DiffusersEngine",
    "vllm_omni": "jaxflow_bridge.engines.vllm_omni.engine:VllmOmniEngine",
    "bagel_torch": "jaxflow_bridge.families.bagel.engine:BagelTorchEngine",
}


def engine_name(config: dict) -> str:
    """`config["engine"]` (default "diffusers"); ValueError naming the known engines."""
    name = config.get("engine", "diffusers")
    if name not in ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; known engines: {sorted(ENGINES)}")
    return name


def engine_class(config: dict) -> type[RolloutEngine]:
    """The engine class `config` asks for, imported on demand."""
    module, _, cls = ENGINES[engine_name(config)].partition(":")
    return getattr(importlib.import_module(module), cls)


class RolloutServer:
    """Engine host: the `RolloutEngine` interface as Ray actor methods, forwarded one to one."""

    warmup_s: float | None = None  # the warm-up request's seconds, where one ran

    def __init__(self, config: dict):
        """`config["warmup"]`, where given: `generate`'s keyword arguments for one request that the server runs and
        discards once its engine is up, before any other call (an actor runs one call at a time): the first
        rollout's one-off costs (its torch.compile, its kernels' first calls) are then paid while the trainer
        still starts. `warmup_s` times it (also in `info()["start"]`, where the engine reports its start)."""
        config = dict(config)
        warmup = config.pop("warmup", None)
        self.engine: RolloutEngine = engine_class(config)(config)
        if warmup is not None:
            began = time.monotonic()
            self.generate(**warmup)
            self.warmup_s = time.monotonic() - began

    def generate(self, prompts: list[str], n: int, sampling: dict, seeds=None, references=None) -> dict:
        """TrajectoryBatch.to_dict() for B = len(prompts) * n samples; seeds: per sample, base, or None; references:
        per prompt its reference images (an edit model's) or None."""
        if references is None:  # engines that serve no edit model keep their signature
            return self.engine.generate(prompts, n, sampling, seeds)
        return self.engine.generate(prompts, n, sampling, seeds, references=references)

    def update_lora(self, tensors, version: int, adapter_config: dict | None = None) -> dict:
        """Serve a PEFT LoRA adapter (dict of arrays, or a path on the server's host) as policy `version`."""
        return self.engine.update_lora(tensors, version, adapter_config)

    def update_lora_shared(self, manifest: dict, version: int, adapter_config: dict | None = None) -> dict:
        """Serve the adapter in the shared-memory file `manifest` names (a file on the server's host)."""
        return self.engine.update_lora_shared(manifest, version, adapter_config)

    def share_base_weights(self, tensors: dict) -> dict:
        """Serve the trainer's base weights as torch tensors, not copied (the engine in the trainer's process)."""
        return self.engine.share_base_weights(tensors)

    def release_adapter(self) -> None:
        """The step's rollouts are over; the next adapter follows (`RolloutEngine.release_adapter`)."""
        self.engine.release_adapter()

    def sleep(self) -> int:
        """Free the engine's GPU memory until `wake`; returns the bytes freed."""
        return self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    def info(self) -> dict:
        """engine, device, dtype, policy_version, model, fingerprint (of the base transformer weights), ..., and the
        server's host (the trainer picks the LoRA transport by it); the warm-up's seconds in "start" where both are."""
        info = {**self.engine.info(), "host": socket.gethostname()}
        if self.warmup_s is not None and info.get("start"):
            info["start"] = {**info["start"], "warmup": self.warmup_s}
        return info


def create_rollout_server(config: dict, name: str | None = None, num_cpus: float = 1, num_gpus: float = 0):
    """Start a RolloutServer actor (Ray must be initialised); unknown engines fail here, before Ray is used."""
    import ray

    engine_name(config)
    options = {"num_cpus": num_cpus, "num_gpus": num_gpus}
    if name is not None:
        options["name"] = name
    return ray.remote(RolloutServer).options(**options).remote(config)
