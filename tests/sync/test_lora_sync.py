"""LoRA sync in process (jaxflow/sync/lora_sync.py): DLPack device tensors into the tiny diffusers engine (CPU) leave the
same bytes as the host path, bad ones are refused atomically, nothing aliases the train state."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxflow.sync.lora_sync import DeviceTarget, device_peft_tensors, device_target
from jaxflow.families.qwen_image.loading import load_transformer
from jaxflow.nn.lora import LoRAParam, lora_to_peft
from jaxflow.families.qwen_image.lora import QwenImageLoRASpec as LoRASpec
from jaxflow.run.rollout_client import LocalTransport, RolloutGroup
from jaxflow_bridge.sync.layers import ADAPTER_NAME

SPEC = LoRASpec(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def trainer_lora(tiny_path):
    """A float32 LoRA state for the tiny transformer, random (B too) so every adapter byte is checked."""
    state = nnx.state(load_transformer(tiny_path / "transformer", lora=SPEC), LoRAParam)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    return jax.tree.unflatten(tree, [jax.random.normal(k, x.shape, jnp.float32) * 0.3 for k, x in zip(keys, leaves)])


def in_process_group(tiny_path, dtype):
    return RolloutGroup({"engine": "diffusers", "model": str(tiny_path), "dtype": dtype, "device": "cpu"},
                        transport=LocalTransport())


def engine_adapters(group) -> dict[str, np.ndarray]:
    """The engine's LoRA weights as raw bits."""
    model = group.servers[0].engine.pipeline.transformer
    return {n: p.detach().view(torch.int16 if p.dtype == torch.bfloat16 else torch.int32).numpy().copy()
            for n, p in model.named_parameters() if f".{ADAPTER_NAME}." in n}


def policy_version(group) -> int:
    return group.info()[0]["policy_version"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_device_sync_leaves_the_host_paths_bytes(tiny_path, trainer_lora, dtype):
    group = in_process_group(tiny_path, dtype)
    target = device_target(group.info()[0])
    assert target == DeviceTarget(jax.devices("cpu")[0], jnp.dtype(dtype))
    config = SPEC.peft_config()
    assert group.update_lora(lora_to_peft(trainer_lora, SPEC), 1, config) == 24  # 12 targets x 2 blocks
    host = engine_adapters(group)
    group.update_lora({k: np.zeros_like(v) for k, v in lora_to_peft(trainer_lora, SPEC).items()}, 2, config)
    assert not any(np.array_equal(host[n], v) for n, v in engine_adapters(group).items())
    tensors = device_peft_tensors(trainer_lora, SPEC, target)
    assert {t.dtype for t in tensors.values()} == {getattr(torch, dtype)}
    assert group.update_lora(tensors, 3, config) == 24
    device = engine_adapters(group)
    assert device.keys() == host.keys() and all(np.array_equal(device[n], host[n]) for n in host)
    assert policy_version(group) == 3


def test_exported_buffers_are_fresh_and_the_engine_keeps_its_own_copy(tiny_path, trainer_lora):
    """The views never share memory with the train state (the next step donates it), and the engine's adapters
    never share memory with the views (the buffers go back to JAX once update_lora returns)."""
    group = in_process_group(tiny_path, "float32")
    state = jax.tree.map(jnp.copy, trainer_lora)
    tensors = device_peft_tensors(state, SPEC, device_target(group.info()[0]))
    state_ptrs = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(state)}
    assert not {t.untyped_storage().data_ptr() for t in tensors.values()} & state_ptrs
    jax.jit(lambda s: jax.tree.map(jnp.zeros_like, s), donate_argnums=0)(state)  # a train step donating the state
    group.update_lora(tensors, 1, SPEC.peft_config())
    served, want = engine_adapters(group), lora_to_peft(trainer_lora, SPEC)  # the values before the donation
    assert len(served) == len(want) == 48
    assert all(np.array_equal(v.view(np.float32), want[n.replace(f".{ADAPTER_NAME}.", ".")]) for n, v in served.items())
    for t in tensors.values():  # test-only write through the views (never in real code): the engine has its copy
        t.fill_(7.0)
    assert all(np.array_equal(served[n], v) for n, v in engine_adapters(group).items())
    assert not any((v.view(np.float32) == 7.0).all() for v in served.values())


def test_bad_device_tensors_are_refused_and_the_previous_adapter_serves(tiny_path, trainer_lora):
    group = in_process_group(tiny_path, "bfloat16")
    target = device_target(group.info()[0])
    group.update_lora(device_peft_tensors(trainer_lora, SPEC, target), 1, SPEC.peft_config())
    before = engine_adapters(group)
    bad = jax.tree.map(lambda x: x * 2, trainer_lora)
    var = bad["blocks"]["attn"]["to_q"]["lora_a"]
    var[...] = var[...].at[1, 0, 0].set(jnp.nan)
    with pytest.raises(ValueError, match=r"refused \(1 offending tensors.*: transformer_blocks\.1\.attn\.to_q\."
                                         r"lora_A\.weight: expected finite floating-point values$"):
        group.update_lora(device_peft_tensors(bad, SPEC, target), 2, SPEC.peft_config())
    assert policy_version(group) == 1
    assert all(np.array_equal(before[n], v) for n, v in engine_adapters(group).items())


def test_device_target_needs_a_device_jax_addresses():
    assert device_target({"device": "cpu", "dtype": "float32"}).device == jax.devices("cpu")[0]
    has_gpu = any(d.platform == "gpu" for d in jax.devices())
    assert (device_target({"device": "cuda:0", "dtype": "bfloat16"}) is not None) == has_gpu
    assert device_target({"device": "mps", "dtype": "float32"}) is None


def test_ray_servers_take_host_arrays_only():
    group = RolloutGroup({}, num_servers=0)  # no actors: the check comes before any call
    with pytest.raises(ValueError, match="must be host numpy arrays .* got Tensor for a.lora_A.weight; device "
                                         "tensors are for rollout.layout=.in_process."):
        group.update_lora({"a.lora_A.weight": torch.zeros(2, 2)}, 1, SPEC.peft_config())


class _Acks:
    """A transport of stand-in servers, each acknowledging a LoRA update with its own bound-module count."""

    max_servers, device_tensors = None, False

    def __init__(self, counts):
        self.counts = iter(counts)

    def start(self, config):
        return next(self.counts)

    def submit(self, server, method, manifest, version, adapter_config):
        return {"version": version, "bound_modules": server}

    def get(self, refs):
        return refs

    def retrying(self, fn, restart, started=True):
        return fn()


def test_every_engine_must_bind_the_same_modules():
    assert RolloutGroup({}, num_servers=3, transport=_Acks([60, 60, 60])).update_lora_shared({}, 2, {}) == 60
    with pytest.raises(RuntimeError, match=r"engines bound different LoRA modules for version 2: \[60, 59, 60\]"):
        RolloutGroup({}, num_servers=3, transport=_Acks([60, 59, 60])).update_lora_shared({}, 2, {})
