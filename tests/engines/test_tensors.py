"""DLPack JAX->torch (jaxflow.sync.lora_sync) and back (a test helper), jaxflow_bridge.rollout.tensors: numpy<->torch bf16 views,
jaxflow_bridge.contract.safetensors_io against the safetensors package (CPU)."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch

from jaxflow.sync.lora_sync import jax_to_torch
from jaxflow_bridge.contract import safetensors_io
from jaxflow_bridge.rollout.tensors import numpy_to_torch, torch_to_numpy

DTYPES = [torch.float32, torch.bfloat16, torch.int32, torch.bool]


def torch_to_jax(t):
    """torch.Tensor -> jax.Array through DLPack, detached and made contiguous first (DLPack export refuses tensors
    that require grad, JAX non-compact strides); on CPU memory is shared when the pointer is 64-byte aligned."""
    return jax.dlpack.from_dlpack(t.detach().contiguous())


def sample(dtype: torch.dtype, shape=(8, 16)) -> torch.Tensor:
    """Values that exercise the bits: random normals plus inf, -0.0 and nan for float dtypes."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 100
    if dtype.is_floating_point:
        x.view(-1)[:4] = torch.tensor([float("inf"), -0.0, float("nan"), -float("inf")])
    return x.to(dtype) if dtype != torch.bool else x > 0


def bits(a: np.ndarray) -> np.ndarray:
    """Integer view of an array's raw bits, for bit-exact comparisons (nan included)."""
    return a.view(f"u{a.dtype.itemsize}") if a.dtype != np.bool_ else a


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_to_jax_shares_memory(dtype):
    t = torch.zeros(64, 32, dtype=dtype)
    j = torch_to_jax(t)
    assert j.unsafe_buffer_pointer() == t.data_ptr()
    assert j.dtype == torch_to_numpy(t).dtype
    t[3, 5] = 7  # aliasing (never do this in real code): the write shows through JAX
    assert float(j[3, 5]) == 7


def test_torch_to_jax_unaligned_view_copies():
    t = torch.arange(65, dtype=torch.float32)[1:]  # data pointer 4 bytes past a 64-byte boundary
    j = torch_to_jax(t)
    assert j.unsafe_buffer_pointer() != t.data_ptr()
    np.testing.assert_array_equal(np.asarray(j), t.numpy())


@pytest.mark.parametrize("make", [
    lambda x: x[:, 1:5],  # non-compact strides: JAX refuses these over DLPack
    lambda x: x.t(),
    lambda x: x.clone().requires_grad_(True),  # DLPack export refuses tensors that require grad
], ids=["sliced", "transposed", "requires_grad"])
def test_torch_to_jax_awkward_tensors(make):
    t = make(torch.randn(8, 16))
    np.testing.assert_array_equal(np.asarray(torch_to_jax(t)), t.detach().numpy())


def test_jax_to_torch_shares_memory():
    a = jnp.arange(256, dtype=jnp.float32) * 2
    t = jax_to_torch(a)
    assert t.data_ptr() == a.unsafe_buffer_pointer()
    assert t.dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dlpack_round_trip_bit_exact(dtype):
    t = sample(dtype)
    j = torch_to_jax(t)
    np.testing.assert_array_equal(bits(np.asarray(j)), bits(torch_to_numpy(t)))
    back = jax_to_torch(jnp.array(j, copy=True))  # a JAX-owned buffer, not the torch alias
    assert back.dtype == dtype
    np.testing.assert_array_equal(bits(torch_to_numpy(back)), bits(torch_to_numpy(t)))


def test_jax_to_torch_sharded_raises():
    # One CPU device in-process; a stand-in for an array split over two devices. (A real 2-device run
    # needs XLA_FLAGS=--xla_force_host_platform_device_count=2 before JAX starts.)
    sharded = SimpleNamespace(shape=(8,), sharding=SimpleNamespace(device_set={0, 1}),
                              is_fully_replicated=False)
    with pytest.raises(ValueError, match="shard by shard"):
        jax_to_torch(sharded)


def test_numpy_torch_bf16_every_bit_pattern():
    a = np.arange(2**16, dtype=np.uint16).view(ml_dtypes.bfloat16).reshape(256, 256)
    t = numpy_to_torch(a)
    assert t.dtype == torch.bfloat16 and t.data_ptr() == a.ctypes.data  # no upcast, no copy
    np.testing.assert_array_equal(t.view(torch.uint16).numpy(), a.view(np.uint16))
    back = torch_to_numpy(t)
    assert back.dtype == ml_dtypes.bfloat16 and back.ctypes.data == a.ctypes.data
    np.testing.assert_array_equal(bits(back), bits(a))


def test_torch_to_numpy_non_contiguous_bf16():
    t = sample(torch.bfloat16).t()[::2]
    np.testing.assert_array_equal(bits(torch_to_numpy(t)), bits(torch_to_numpy(t.contiguous())))


@pytest.mark.filterwarnings("error")
def test_numpy_to_torch_read_only_and_negative_strides_copy():
    a = np.arange(6, dtype=np.float32)
    a.flags.writeable = False
    t = numpy_to_torch(a)
    assert t.data_ptr() != a.ctypes.data and t.tolist() == a.tolist()
    assert numpy_to_torch(np.arange(6)[::-1]).tolist() == [5, 4, 3, 2, 1, 0]


def test_safetensors_files_round_trip_bit_exact_and_match_the_reference(tmp_path):
    """jaxflow_bridge.contract.safetensors_io writes plain safetensors (bf16 as BF16) and reads what safetensors.torch writes."""
    tensors = {f"t_{d}".replace("torch.", ""): torch_to_numpy(sample(d)) for d in DTYPES}
    tensors["np_bf16"] = np.arange(2**16, dtype=np.uint16).view(ml_dtypes.bfloat16)
    tensors["np_scalar"] = np.array(3, np.int64)
    tensors["np_empty"] = np.zeros((0, 4), np.float32)
    tensors["np_transposed"] = np.arange(12, dtype=np.float64).reshape(3, 4).T
    tensors["np_u16"] = np.arange(5, dtype=np.uint16)
    safetensors_io.save(tensors, tmp_path / "ours.safetensors")
    reference = safetensors.torch.load_file(tmp_path / "ours.safetensors")
    assert reference["t_bfloat16"].dtype == torch.bfloat16
    safetensors.torch.save_file({k: numpy_to_torch(v).contiguous() for k, v in tensors.items()},
                                tmp_path / "ref.safetensors")
    for got in (safetensors_io.load(tmp_path / "ours.safetensors"), safetensors_io.load(tmp_path / "ref.safetensors"),
                {k: torch_to_numpy(v) for k, v in reference.items()}):
        for name, want in tensors.items():
            assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
            np.testing.assert_array_equal(bits(got[name]), bits(want), err_msg=name)


def test_safetensors_streamed_asks_for_each_tensor_in_key_order_and_checks_it(tmp_path):
    """save_streamed takes the header from specs and each tensor from produce(key), in sorted key order: the file is
    save()'s byte for byte; a produced tensor unlike its spec is refused by name and no file (nor PATH.tmp) stays."""
    tensors = {"b": np.arange(6, dtype=np.float32).reshape(2, 3), "a": np.ones(4, ml_dtypes.bfloat16),
               "c": np.array(7, np.int64)}
    asked = []
    specs = {k: (v.dtype, v.shape) for k, v in tensors.items()}
    safetensors_io.save_streamed(specs, lambda k: asked.append(k) or tensors[k], tmp_path / "s.safetensors", {"x": "1"})
    safetensors_io.save(tensors, tmp_path / "w.safetensors", {"x": "1"})
    assert asked == ["a", "b", "c"]
    assert (tmp_path / "s.safetensors").read_bytes() == (tmp_path / "w.safetensors").read_bytes()
    back = safetensors.torch.load_file(tmp_path / "s.safetensors")
    assert back["b"].tolist() == tensors["b"].tolist() and back["a"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"b came as float32 \(3, 2\), its header says F32 \[2, 3\]"):
        safetensors_io.save_streamed(specs, lambda k: tensors[k].T if k == "b" else tensors[k], tmp_path / "bad")
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad.tmp").exists()  # no partial file either
