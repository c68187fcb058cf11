"""Mesh, logical-axis rules and the sharded train step (8 forced CPU devices, in a subprocess)."""

import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from jaxflow.trainer import sharding as S
from tests.helpers import random_window_batch
from tests import HANG_S

ROOT = Path(__file__).resolve().parents[2]


def _layout(shape, rules=S.FSDP_RULES):
    return S.Layout(AbstractMesh(shape, S.MESH_AXES, axis_types=(AxisType.Auto,) * 3), rules)


def test_mesh_shape_fill_and_validation():
    assert S.ShardingConfig().mesh_shape(8) == (8, 1, 1)
    assert S.ShardingConfig(data=-1, fsdp=4).mesh_shape(8) == (2, 4, 1)
    assert S.ShardingConfig(data=2, fsdp=-1, tensor=2).mesh_shape(8) == (2, 2, 2)
    for bad in (S.ShardingConfig(data=2, fsdp=2), S.ShardingConfig(data=-1, fsdp=-1), S.ShardingConfig(fsdp=3),
                S.ShardingConfig(data=0)):
        with pytest.raises(ValueError, match="mesh"):
            bad.mesh_shape(8)
    mesh = S.make_mesh(S.ShardingConfig())
    assert mesh.axis_names == S.MESH_AXES and mesh.axis_types == (AxisType.Auto,) * 3


def test_specs_from_rules():
    layout = _layout((2, 4, 1), S.FSDP_RULES + (("mlp", ("fsdp", "tensor")), ("heads", "tensor")))
    assert layout.spec(("embed", "mlp"), (64, 256)) == P("fsdp", None)  # fsdp already used by dim 0
    assert layout.spec(("mlp", "embed"), (256, 64)) == P("fsdp", None)
    assert layout.spec(("embed", "heads"), (2, 64, 64)) == P(None, "fsdp", None)  # stacked layer axis replicated
    assert layout.spec(("heads",), (64,)) == P(None)  # tensor has size 1
    assert layout.spec(None, (3, 5)) == P(None, None)
    assert layout.spec(("latent", None), (64, 8)) == P(None, None)  # no rule: replicated
    assert layout.batch_axes == ("data", "fsdp") and layout.batch_devices == 8
    assert _layout((8, 1, 1), S.DEFAULT_RULES).batch_axes == ("data",)
    assert _layout((8, 1, 1), S.DEFAULT_RULES).spec(("embed", "mlp"), (64, 256)) == P(None, None)
    with pytest.raises(ValueError, match="not in"):
        _layout((8, 1, 1), (("embed", "model"),))
    with pytest.raises(ValueError, match="more entries"):
        layout.spec(("embed", "mlp"), (64,))


def test_indivisible_dim_is_replicated_and_logged_once(caplog):
    layout = _layout((1, 4, 1))
    with caplog.at_level(logging.WARNING, logger="jaxflow.trainer.sharding"):
        assert layout.spec(("embed",), (6,)) == P(None)
        assert layout.spec(("embed", None), (6, 3)) == P(None, None)
    assert len([r for r in caplog.records if "not divisible" in r.getMessage()]) == 1


def test_maybe_initialize_distributed(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    for key in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_NTASKS",
                "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert not S.maybe_initialize_distributed() and not calls
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert not S.maybe_initialize_distributed() and not calls
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert S.maybe_initialize_distributed() and calls == [{}]
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    assert S.maybe_initialize_distributed()
    assert calls[-1] == {"coordinator_address": "10.0.0.1:1234", "num_processes": 2, "process_id": 1}


# ---------------------------------------------------------------------------------------------- 8 devices


def _eight_device_check():
    """Run in a subprocess with 8 forced CPU devices: loading with sharding_fn, and one train step on two
    meshes equal to the single-device step."""
    from flax import nnx

    from jaxflow.families.qwen_image import loading
    from jaxflow.nn.weights import TensorSource
    from jaxflow.families.qwen_image.config import QwenImageConfig
    from jaxflow.nn.config import ModelOptions
    from jaxflow.nn.lora import LoRAParam
    from jaxflow.families.qwen_image.lora import QwenImageLoRASpec as LoRASpec
    from jaxflow.families.qwen_image.transformer import QwenImageTransformer
    from jaxflow.trainer.step_config import TrainConfig
    from jaxflow.trainer.train_step import make_train_step

    assert jax.device_count() == 8
    cfg = QwenImageConfig(num_layers=2, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=64,
                          axes_dims_rope=(8, 12, 12))
    spec = LoRASpec(rank=4, alpha=8.0, targets=("to_q", "to_v", "img_mlp.net.2"))
    model = QwenImageTransformer(cfg, ModelOptions(), spec, rngs=nnx.Rngs(0))
    source = TensorSource(loading.to_diffusers_state_dict(model))
    fsdp = S.Layout.create(S.ShardingConfig(data=2, fsdp=4, rules=S.FSDP_RULES))
    loaded = loading.build_from_source(cfg, source, sharding=fsdp.sharding_fn)
    kernel = loaded.blocks.img_mlp_in.kernel  # (layers, embed, mlp)
    assert kernel.sharding.spec == P(None, "fsdp", None), kernel.sharding
    np.testing.assert_array_equal(model.blocks.img_mlp_in.kernel[...], kernel[...])
    loaded.opts = dataclasses.replace(loaded.opts, scan_unroll=2)
    loaded.unstack_blocks()  # one array per block, each keeping the stack's sharding of its other axes
    pieces = loaded.blocks.img_mlp_in.kernel.get_value()
    assert [p.sharding.spec for p in pieces] == [P("fsdp", None)] * 2, [p.sharding for p in pieces]
    np.testing.assert_array_equal(model.blocks.img_mlp_in.kernel[...], np.stack(pieces))
    leaves, treedef = jax.tree.flatten(nnx.state(model, LoRAParam))  # non-zero B: every LoRA param gets a gradient
    nnx.update(model, jax.tree.unflatten(
        treedef, [x + 0.1 * jax.random.normal(jax.random.key(i), x.shape) for i, x in enumerate(leaves)]))
    batch = random_window_batch(16)
    config = TrainConfig(guidance=1.0, grid_hw=(2, 2), num_micro_batches=2, clip_range=1e-2)
    results = {"before": jax.tree.map(np.asarray, nnx.state(model, LoRAParam))}
    for name, layout in [("single", None), ("data8", S.Layout.create(S.ShardingConfig(data=8))), ("fsdp", fsdp)]:
        init_state, step = make_train_step(model, config, layout)
        state, metrics = step(init_state(), batch)
        assert int(metrics["skipped"]) == 0
        results[name] = jax.tree.map(np.asarray, state.lora)
        if name == "fsdp":
            lora_a = state.lora["blocks"]["attn"]["to_q"]["lora_a"]  # (layers, embed, rank)
            mu = state.opt_state[1][0].mu["blocks"]["attn"]["to_q"]["lora_a"]
            assert lora_a.sharding.spec == mu.sharding.spec == P(None, "fsdp", None)
    model.opts = dataclasses.replace(model.opts, scan_unroll=2)  # the blocks unrolled, weights held per block
    model.unstack_blocks()
    init_state, step = make_train_step(model, config, fsdp)
    state, _ = step(init_state(), batch)
    results["fsdp_unrolled"] = jax.tree.map(np.asarray, state.lora)
    for name in ("data8", "fsdp", "fsdp_unrolled"):
        for got, want in zip(jax.tree.leaves(results[name]), jax.tree.leaves(results["single"])):
            np.testing.assert_allclose(got, want, atol=1e-6, rtol=0, err_msg=name)
    moved = [np.abs(a - b).max() for a, b in zip(*(jax.tree.leaves(results[k]) for k in ("single", "before")))]
    assert min(moved) > 1e-4  # the update did something to every LoRA param
    # true CFG's batched call keeps each device's rows on it: no all-to-all (ncclAlltoAll on GPUs) in the update
    from jaxflow.trainer.train_step import prepare_batch
    guided = dataclasses.replace(batch, negative_prompt_embeds=batch.prompt_embeds[::-1].copy(),
                                 negative_prompt_mask=batch.prompt_mask[::-1].copy())
    config = dataclasses.replace(config, guidance=4.0)
    _, step = make_train_step(model, config, S.Layout.create(S.ShardingConfig(data=8)))
    shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in prepare_batch(guided, config).items()}
    hlo = step.compile(shapes, None)["update"].as_text()
    assert "all-reduce" in hlo and "all-to-all" not in hlo, [ln for ln in hlo.splitlines() if "all-to-all" in ln][:3]
    print("EIGHT_DEVICES_OK")


@pytest.mark.slow
def test_sharded_step_equals_single_device():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    code = "import tests.trainer.test_sharding as t; t._eight_device_check()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=HANG_S)
    assert proc.returncode == 0 and "EIGHT_DEVICES_OK" in proc.stdout, proc.stdout + proc.stderr[-5000:]
