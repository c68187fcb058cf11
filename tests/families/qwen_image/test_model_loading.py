"""diffusers-format checkpoint loading/saving through the declarative key map."""
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import QwenImageTransformer2DModel
from flax import nnx

from jaxflow.families.qwen_image.config import QwenImageConfig
from jaxflow.nn.config import ModelOptions
from jaxflow.families.qwen_image.loading import (build_from_source, load_transformer,
                                    save_transformer, to_diffusers_state_dict)
from jaxflow.nn.weights import INDEX, WEIGHTS, TensorSource
from jaxflow.nn.lora import LoRAParam
from jaxflow.families.qwen_image.lora import QwenImageLoRASpec as LoRASpec
from jaxflow.families.qwen_image.transformer import QwenImageTransformer
from jaxflow_bridge.contract import safetensors_io
from jaxflow_bridge.families.qwen_image import keymap
from tests.qwen_ref import TINY, inputs, state_dict_numpy, torch_forward, torch_model


def _leaf_paths(state):
    return {tuple(str(p) for p in path) for path, _ in nnx.to_flat_state(state)}


def test_key_map_covers_every_param_both_ways():
    cfg = QwenImageConfig(**TINY)
    model = nnx.eval_shape(lambda: QwenImageTransformer(cfg, rngs=nnx.Rngs(0)))
    flax_paths = _leaf_paths(nnx.state(model, nnx.Param))
    entries = keymap.transformer_key_map()
    assert {e.flax_path for e in entries} == flax_paths
    torch_keys = set(torch_model(TINY).state_dict())
    mapped = {k for e in entries for k in e.diffusers_keys(cfg.num_layers)}
    assert mapped == torch_keys
    assert len(mapped) == sum(len(e.diffusers_keys(cfg.num_layers)) for e in entries)  # no key mapped twice


def test_lora_key_map_covers_every_lora_param():
    cfg = QwenImageConfig(**TINY)
    spec = LoRASpec(rank=4, alpha=8)
    model = nnx.eval_shape(lambda: QwenImageTransformer(cfg, lora=spec, rngs=nnx.Rngs(0)))
    assert {e.flax_path for e in keymap.lora_key_map(spec.targets)} == _leaf_paths(nnx.state(model, LoRAParam))


@pytest.mark.parametrize("shard_bytes", [None, 200_000])
def test_load_diffusers_folder_single_and_sharded(tmp_path, shard_bytes):
    tm = torch_model(TINY)
    kwargs = {} if shard_bytes is None else {"max_shard_size": shard_bytes}
    tm.save_pretrained(tmp_path, safe_serialization=True, **kwargs)
    assert (tmp_path / (WEIGHTS if shard_bytes is None else INDEX)).exists()
    model = load_transformer(tmp_path)
    x, s, txt, mask = inputs(TINY)
    ref = torch_forward(tm, x, s, txt, mask, (5, 9))
    out = np.asarray(model(jnp.asarray(x), jnp.asarray(s), jnp.asarray(txt), jnp.asarray(mask), (5, 9)))
    assert np.max(np.abs(out - ref)) / np.max(np.abs(ref)) <= 1e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_save_round_trip_is_bit_exact(tmp_path, dtype):
    tm = torch_model(TINY).to(getattr(torch, dtype))
    tm.save_pretrained(tmp_path / "in")
    model = load_transformer(tmp_path / "in", ModelOptions(dtype=dtype, param_dtype=dtype))
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        assert var.dtype == jnp.dtype(dtype), path  # bf16 read without upcasting
    save_transformer(model, tmp_path / "out", max_shard_bytes=300_000)
    assert (tmp_path / "out" / INDEX).exists()
    src = TensorSource.from_folder(tmp_path / "out")
    ref = tm.state_dict()
    assert src.keys() == set(ref)
    for k, v in ref.items():
        got = src.get(k)
        want = v.view(torch.int16).numpy() if dtype == "bfloat16" else v.numpy()
        np.testing.assert_array_equal(got.view(np.int16) if dtype == "bfloat16" else got, want, err_msg=k)
    # diffusers itself loads what we wrote.
    back = QwenImageTransformer2DModel.from_pretrained(tmp_path / "out", dtype=getattr(torch, dtype))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_layers"] == TINY["num_layers"]
    for k, v in back.state_dict().items():
        torch.testing.assert_close(v, ref[k], rtol=0, atol=0)


def _error(tensors, cfg=TINY):
    with pytest.raises(ValueError) as e:
        build_from_source(QwenImageConfig(**cfg), TensorSource(tensors))
    return str(e.value)


def test_missing_unexpected_and_misshaped_keys_are_listed():
    sd = state_dict_numpy(torch_model(TINY))
    sd.pop("proj_out.bias")
    sd["transformer_blocks.0.attn.to_q.weight"] = np.zeros((3, 3), np.float32)
    sd["extra.weight"] = np.zeros(2, np.float32)
    msg = _error(sd)
    assert "missing proj_out.bias" in msg
    assert "unexpected extra.weight" in msg
    assert "shape transformer_blocks.0.attn.to_q.weight" in msg
    assert "3 problem(s)" in msg


def test_error_lists_first_20_and_count():
    sd = {k: v for k, v in state_dict_numpy(torch_model(TINY)).items() if not k.startswith("transformer_blocks")}
    msg = _error(sd)
    n_block_keys = len([k for k in torch_model(TINY).state_dict() if k.startswith("transformer_blocks")])
    assert f"{n_block_keys} problem(s); first 20" in msg


@pytest.mark.parametrize("bad, key", [
    (dict(axes_dims_rope=(8, 12, 14)), "attention_head_dim"),
    (dict(axes_dims_rope=(7, 13, 12)), "even"),
    (dict(out_channels=8), "in_channels"),
    (dict(guidance_embeds=True), "guidance_embeds"),
])
def test_invalid_config_rejected_naming_the_key(bad, key):
    with pytest.raises(ValueError, match=key):
        QwenImageConfig(**{**TINY, **bad})


def test_unknown_config_key_rejected():
    with pytest.raises(ValueError, match="not_a_key"):
        QwenImageConfig.from_dict({**TINY, "not_a_key": 1})


def test_safetensors_io_round_trip_bf16(tmp_path):
    import ml_dtypes
    t = {"a": np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16), "b": np.ones(3, np.int64)}
    safetensors_io.save(t, tmp_path / "x.safetensors")
    from safetensors.torch import load_file
    back = load_file(tmp_path / "x.safetensors")
    assert back["a"].dtype == torch.bfloat16 and back["a"].float().tolist() == [[0, 1, 2], [3, 4, 5]]
    got = safetensors_io.load(tmp_path / "x.safetensors")
    assert got["a"].dtype == ml_dtypes.bfloat16 and np.array_equal(got["b"], t["b"])


def test_state_dict_export_matches_torch():
    tm = torch_model(TINY)
    model = build_from_source(QwenImageConfig(**TINY), TensorSource(state_dict_numpy(tm)))
    out = to_diffusers_state_dict(model)
    for k, v in tm.state_dict().items():
        np.testing.assert_array_equal(out[k], v.numpy(), err_msg=k)
