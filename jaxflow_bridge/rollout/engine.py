"""The rollout engine interface: what a `RolloutServer` (jaxflow_bridge/rollout/server.py) hosts and forwards to.

Engines are built from one config dict; everything crossing the interface is numpy arrays or plain Python (safe
over Ray). Never imports JAX.
"""

from __future__ import annotations

import abc

import numpy as np


def policy_version(version) -> int:
    """An update's policy version as an int (a numpy integer too); ValueError for anything else, bools included."""
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)):
        raise ValueError(f"version must be an int, got {version!r}")
    return int(version)


class RolloutEngine(abc.ABC):
    """generate / update_lora / release_adapter / sleep / wake / info, plus the checks every engine shares. Subclasses set `name`
    (the registry key, `config["engine"]`), `config_keys` (the config keys they know) and `asleep`."""

    name: str
    config_keys: tuple[str, ...]
    asleep: bool

    @classmethod
    def check_config(cls, config: dict) -> None:
        """ValueError unless `config` names a model and uses only `config_keys`."""
        unknown = sorted(set(config) - set(cls.config_keys))
        if unknown or "model" not in config:
            raise ValueError(f"{cls.name} engine config: needs 'model', knows {list(cls.config_keys)}, "
                             f"got unknown keys {unknown}")

    def check_awake(self) -> None:
        """RuntimeError while asleep: generate and update_lora need the weights in place."""
        if self.asleep:
            raise RuntimeError("the rollout engine is asleep: call wake() first")

    @abc.abstractmethod
    def generate(self, prompts: list[str], n: int, sampling: dict, seeds=None, references=None) -> dict:
        """TrajectoryBatch.to_dict() for B = len(prompts) * n samples, prompt-major; sampling: SamplingParams
        fields; seeds: one per sample, a base seed, or None (sampling's seed); references: an edit model's reference
        images, one uint8 (R, H, W, 3) array per prompt (sent once for its group), or None."""

    @abc.abstractmethod
    def update_lora(self, tensors, version: int, adapter_config: dict | None = None) -> dict:
        """Serve a PEFT LoRA adapter (dict of arrays, or a path on the engine's host) as policy `version`;
        returns {"version", "bound_modules", "served": `ServedProbe.to_dict()` of what the engine now serves, read
        from its own memory (jaxflow_bridge/contract/served.py)}. A refused adapter leaves the previous one serving."""

    def update_lora_shared(self, manifest: dict, version: int, adapter_config: dict | None = None) -> dict:
        """`update_lora` from a shared-memory adapter file on this host (jaxflow_bridge/contract/lora_shm.py; the manifest
        names it); FileNotFoundError if the file is not here. Engines with a faster way in override this."""
        from jaxflow_bridge.contract.lora_shm import read_arrays
        return self.update_lora(read_arrays(manifest), version, adapter_config)

    def share_base_weights(self, tensors: dict) -> dict:
        """Serve base weights given as torch tensors in the engine's process, without a copy; returns info().
        Engines that keep their own weights refuse."""
        raise NotImplementedError(f"the {self.name} engine keeps its own base weights")

    def release_adapter(self) -> None:
        """The step's rollouts are over and the next adapter follows (`update_lora`): an engine that merged its
        adapter into the base weights starts restoring them now, while the trainer trains, and refuses to sample
        until the update. Others do nothing."""

    def close(self) -> None:
        """Stop what the engine started beside this process (vLLM-Omni's stage processes); a process that built the
        engine itself calls it before it exits. Others hold nothing to stop."""

    @abc.abstractmethod
    def sleep(self) -> int:
        """Free the engine's GPU memory until `wake`; returns the bytes freed."""

    @abc.abstractmethod
    def wake(self) -> None:
        """Bring the weights back to the GPU."""

    @abc.abstractmethod
    def info(self) -> dict:
        """engine, device, dtype, policy_version, model, fingerprint (of the base transformer weights),
        size_multiple, lora_modules, asleep, lora_apply (how it serves the LoRA: "layers", "merged" or "folder")."""
