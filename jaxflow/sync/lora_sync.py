"""The form the trainer's LoRA takes on its way to the rollout engine (the trainer's glue; JAX and torch meet here).

Across processes (Ray actors) on this host the engine reads the adapter from one shared-memory file
(`SharedLoRA`, jaxflow_bridge/contract/lora_shm.py): transposed to PEFT's layout, cast to the engine's dtype and laid out
flat in one jit on the device, copied to the host once, written once; only the manifest crosses Ray. An engine on
another host gets host numpy PEFT arrays (`lora_to_peft`), which Ray ships as bytes.
When the engine shares the trainer's process (`rollout.layout="in_process"`) on a device JAX addresses, it gets device
tensors instead, with no host round trip: each stacked LoRA weight is transposed to PEFT's (out, in) layout and
cast to the engine's dtype in one jit on the device, moved to the engine's device if it is another one, and
exported to torch through DLPack (`jax_to_torch`); each layer is a view of its stack.

Aliasing: JAX assumes its arrays never change, so nothing may write through a view. The views share memory with
fresh JAX buffers made for the export, never with the train state (the next train step donates that), and the
engine only reads them: `LoraApplier.apply` copies them into its adapters and waits for the copies before it
returns, after which the views, and the buffers with them, are dropped. The cast to the engine's dtype rounds as
torch's copy into the adapters does, so both forms leave the same bytes in the engine.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxflow.nn.lora import LoRASpec, peft_stacks
from jaxflow_bridge.contract.lora_shm import SharedAdapterFile

_PLATFORMS = {"cpu": "cpu", "cuda": "gpu"}


@dataclasses.dataclass(frozen=True)
class DeviceTarget:
    """Where an in-process engine keeps its adapters: a JAX device (the memory its torch device names) and dtype."""

    device: jax.Device
    dtype: jnp.dtype


def device_target(info: dict) -> DeviceTarget | None:
    """The target of an engine's `info()` ("device": "cpu", "cuda" or "cuda:N"; "dtype"), or None when JAX has no
    such device (e.g. a JAX built for the CPU only): the host path serves then."""
    kind, _, index = str(info["device"]).partition(":")
    if kind not in _PLATFORMS:
        return None
    try:
        devices = jax.local_devices(backend=_PLATFORMS[kind])
    except RuntimeError:  # no such backend
        return None
    if kind == "cpu":
        device = devices[0]
    else:  # torch's cuda:N and JAX's local_hardware_id count the same visible GPUs
        device = next((d for d in devices if d.local_hardware_id == int(index or 0)), None)
    return None if device is None else DeviceTarget(device, jnp.dtype(info["dtype"]))


def jax_to_torch(a):
    """jax.Array -> torch.Tensor through DLPack, sharing memory (the tensor must not be written to).

    DLPack exports single-device buffers only. A fully replicated multi-device array is exported
    from its first addressable shard; a sharded array raises ValueError: convert it shard by shard,
    `[jax_to_torch(s.data) for s in a.addressable_shards]`.
    """
    import torch

    if len(a.sharding.device_set) > 1:
        if not a.is_fully_replicated:
            raise ValueError(
                f"jax_to_torch: array of shape {a.shape} is sharded over "
                f"{len(a.sharding.device_set)} devices ({a.sharding}); DLPack exports one buffer, "
                "so convert shard by shard: [jax_to_torch(s.data) for s in a.addressable_shards]")
        a = a.addressable_shards[0].data
    return torch.from_dlpack(a)


def device_peft_tensors(lora, spec: LoRASpec, target: DeviceTarget) -> dict:
    """{PEFT key: torch.Tensor} on `target`'s device in its dtype: DLPack views of fresh JAX buffers (see above).
    `lora` is the model's or the train state's LoRA state; it is only read."""
    out = {}
    for keys, stacked in peft_stacks(lora, spec, target.dtype):
        stack = jax_to_torch(jax.device_put(stacked, target.device))
        out.update(zip(keys, stack.unbind(0)))
    return out


class SharedLoRA:
    """The train state's LoRA as a shared-memory adapter file for engines on this host; `write(lora)` returns the
    manifest to send (jaxflow_bridge/contract/lora_shm.py). lora_A stacks come first, then lora_B's, so an engine scales
    every B in one operation."""

    def __init__(self, spec: LoRASpec, dtype: str = "bfloat16"):
        self.spec, self.dtype = spec, dtype
        self.file = SharedAdapterFile(dtype)
        self.entries, self._host = None, None
        self._flat = jax.jit(self._flatten)

    def _flatten(self, lora):
        stacks = sorted(peft_stacks(lora, self.spec, jnp.dtype(self.dtype)), key=lambda ks: "lora_B" in ks[0][0])
        self.entries = [(key, tuple(int(d) for d in x.shape[1:])) for keys, x in stacks for key in keys]
        cat = jnp.concatenate if isinstance(stacks[0][1], jax.Array) else np.concatenate
        return cat([x.reshape(-1) for _, x in stacks])

    def write(self, lora) -> dict:
        """Write `lora` (device arrays, or the host arrays a multi-process gather gives) and return the manifest.
        From a GPU the flat array goes straight into the file, page-locked once (`_to_file`): one copy."""
        if not isinstance(jax.tree.leaves(lora)[0], jax.Array):
            return self.file.write(self._flatten(lora), self.entries)
        flat = self._flat(lora)
        if next(iter(flat.devices())).platform != "gpu":
            return self.file.write(np.asarray(flat), self.entries)
        self.file.payload(self.entries)  # the file at its size
        self._to_file(flat)
        return self.file.seal(self.entries)

    def _to_file(self, flat) -> None:
        """Device-to-host copy of `flat` into the file's pages through torch (DLPack view of the JAX buffer, the
        file mapped and registered with CUDA once)."""
        import torch

        from jaxflow_bridge.contract.lora_shm import TOKEN_BYTES
        nbytes = flat.size * flat.dtype.itemsize
        if self._host is None or self._host.numel() != flat.size:
            raw = torch.from_file(str(self.file.path), shared=True, size=TOKEN_BYTES + nbytes, dtype=torch.uint8)
            self._host = raw[TOKEN_BYTES:].view(getattr(torch, self.dtype))
            torch.cuda.cudart().cudaHostRegister(self._host.data_ptr(), nbytes, 0)  # pageable if it fails
        self._host.copy_(jax_to_torch(flat))
        torch.cuda.synchronize()

    def close(self) -> None:
        if self._host is not None:
            import torch
            torch.cuda.cudart().cudaHostUnregister(self._host.data_ptr())
            self._host = None
        self.file.close()
