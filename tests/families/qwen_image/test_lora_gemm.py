"""The fused LoRA GEMM's contract on a CPU: its custom VJP (with an XLA stand-in for the Hopper kernel), the model's
wiring of model.lora_gemm, the kernel's shape checks and tile walk. The kernel itself runs only on an H100/H200
(scripts/bench_lora_gemm.py checks it against an fp32 reference there)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxflow.config import derived
from jaxflow.nn import layers
from jaxflow.families.qwen_image.config import QwenImageConfig
from jaxflow.nn.config import ModelOptions
from jaxflow.families.qwen_image.lora import QwenImageLoRASpec as LoRASpec
from jaxflow.nn.lora_gemm import Tiling, tile_order, check_shapes, lora_linear, lora_matmul, smem_bytes
from jaxflow.families.qwen_image.transformer import QwenImageTransformer
from tests.qwen_ref import TINY
from tests import HANG_S


def xla_matmul(x, w, u, v, bias=None, *, transposed=False, marker=False):
    """lora_matmul's contract in XLA ops; `marker` names the result by orientation so a jaxpr shows each call."""
    y = x @ (w.T if transposed else w) + u @ (v.T if transposed else v)
    y = y if bias is None else y + bias
    return checkpoint_name(y, "fused_bwd" if transposed else "fused_fwd") if marker else y


def _operands(m=24, k=16, n=12, r=4, seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    return (jax.random.normal(ks[0], (m, k)), jax.random.normal(ks[1], (k, n)), jax.random.normal(ks[2], (n,)),
            jax.random.normal(ks[3], (k, r)), jax.random.normal(ks[4], (r, n)))


def test_custom_vjp_matches_autodiff_of_the_plain_linear():
    x, w, bias, a, b = _operands()
    plain = lambda x, a, b: jnp.sum(jnp.sin(x @ w + bias + (x @ a) @ b))  # noqa: E731
    fused = lambda x, a, b: jnp.sum(jnp.sin(lora_linear(x, w, bias, a, b, xla_matmul)))  # noqa: E731
    np.testing.assert_allclose(fused(x, a, b), plain(x, a, b), rtol=1e-5)
    for got, want in zip(jax.grad(fused, argnums=(0, 1, 2))(x, a, b), jax.grad(plain, argnums=(0, 1, 2))(x, a, b)):
        # fp32 sums of <= 16 products each, in a different order: a few ulps of the largest term
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))


def _count_names(jaxpr, name: str) -> int:
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == "name" and eqn.params.get("name") == name
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else [p]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += _count_names(inner, name)
    return n


def test_remat_does_not_run_the_fused_forward_again():
    """Under the blocks' remat policy the backward needs only x A and the inputs: the fused forward GEMM runs once,
    the fused input-gradient GEMM once."""
    x, w, bias, a, b = _operands()
    mm = functools.partial(xla_matmul, marker=True)

    def layer(lora, x):
        return jnp.sum(jnp.cos(checkpoint_name(lora_linear(jnp.tanh(x), w, bias, *lora, mm), "qkv")))

    policy = jax.checkpoint_policies.save_only_these_names("qkv", "mlp_hidden")
    jaxpr = jax.make_jaxpr(jax.grad(jax.checkpoint(layer, policy=policy), argnums=(0, 1)))((a, b), x).jaxpr
    assert (_count_names(jaxpr, "fused_fwd"), _count_names(jaxpr, "fused_bwd")) == (1, 1)


def test_linear_pallas_path_is_the_xla_path(monkeypatch):
    """Linear(gemm="pallas") hands lora_linear the scaled B, the bias and 2-D rows: with the XLA stand-in it equals
    the XLA path (same ops, same order) for a 3-D input and a non-unit lora_scale."""
    monkeypatch.setattr(layers, "lora_linear", functools.partial(lora_linear, matmul=xla_matmul))
    lin = layers.Linear(16, 12, axes=("embed", "mlp"), dtype=jnp.float32, param_dtype=jnp.float32,
                        rngs=nnx.Rngs(0), lora=LoRASpec(rank=4, alpha=8.0))
    lin.lora_b[...] = jax.random.normal(jax.random.key(3), (4, 12))
    x = jax.random.normal(jax.random.key(1), (2, 5, 16))
    np.testing.assert_allclose(lin(x, 0.5, "pallas"), lin(x, 0.5, "xla"), rtol=1e-6, atol=1e-6)


def test_pallas_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="lora_gemm=xla"):
        QwenImageTransformer(QwenImageConfig(**TINY), ModelOptions(lora_gemm="pallas"), LoRASpec(rank=4, alpha=8.0),
                             rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="lora_gemm"):
        ModelOptions(lora_gemm="triton")


def test_shape_checks_name_the_fix():
    t = Tiling()
    x, w = jnp.zeros((256, 128), jnp.bfloat16), jnp.zeros((128, 512), jnp.bfloat16)
    u, v = jnp.zeros((256, 64), jnp.bfloat16), jnp.zeros((64, 512), jnp.bfloat16)
    assert check_shapes(x, w, u, v, jnp.zeros((512,)), False, t) == (256, 128, 512, 64)
    assert check_shapes(x, w.T, u, v.T, None, True, t) == (256, 128, 512, 64)
    with pytest.raises(ValueError, match="multiples of 128"):
        check_shapes(x[:200], w, u[:200], v, None, False, t)
    with pytest.raises(ValueError, match="do not chain"):
        check_shapes(x, w, u, v[:32], None, False, t)
    with pytest.raises(ValueError, match="one dtype"):
        check_shapes(x, w.astype(jnp.float32), u, v, None, False, t)
    with pytest.raises(ValueError, match="shared memory"):
        check_shapes(x, w, u, v, None, False, Tiling(stages=4))
    assert smem_bytes(Tiling(stages=4), 64) > smem_bytes(t, 64)
    with pytest.raises(ValueError, match="lora_matmul"):
        lora_matmul(x, w, u, v[:32])


@pytest.mark.parametrize("rows,transposed", [(200, False), (192, True), (256, False)])
def test_rows_short_of_a_tile_are_padded_for_the_kernel(monkeypatch, rows, transposed):
    """lora_matmul hands the kernel whole 128-row tiles (zero rows appended) and returns the caller's rows: the
    kernel (an XLA stand-in here) sees M padded, the result equals the unpadded product."""
    from jaxflow.nn import lora_gemm

    seen = []

    def kernel_call(m, n, dtype, transposed, has_bias, tiling):
        def run(x, w, u, v, b):
            seen.append((m, x.shape[0], u.shape[0]))
            return xla_matmul(x, w, u, v, b if has_bias else None, transposed=transposed)
        return run

    monkeypatch.setattr(lora_gemm, "_kernel_call", kernel_call)
    x, w, u, v = (jax.random.normal(jax.random.key(i), shape) for i, shape in
                  enumerate(((rows, 128), (128, 512), (rows, 16), (16, 512))))
    if transposed:
        w, v = w.T, v.T
    got = lora_matmul(x, w, u, v, transposed=transposed)
    assert got.shape == (rows, 512) and seen == [(-(-rows // 128) * 128,) * 3]
    want = xla_matmul(x, w, u, v, transposed=transposed)  # fp32 sums of 144 products; the GEMM's blocking may
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))  # follow M


@pytest.mark.parametrize("m_tiles,n_tiles,group", [(8, 12, 8), (10, 3, 4), (1, 5, 8), (7, 7, 16)])
def test_tile_walk_visits_every_output_tile_once(m_tiles, n_tiles, group):
    lin = jnp.arange(m_tiles * n_tiles)
    mi, ni = tile_order(lin, m_tiles, n_tiles, group)
    assert sorted(zip(np.asarray(mi).tolist(), np.asarray(ni).tolist())) == [
        (i, j) for i in range(m_tiles) for j in range(n_tiles)]
    # consecutive steps stay in one band of `group` tile rows (W's columns are reused from L2)
    assert int(jnp.max(mi[:group * n_tiles])) < min(group, m_tiles)


def test_pallas_turns_off_dynamic_slice_fusion_unless_set():
    from jaxflow.config.recipes import base

    cfg = base()
    assert "xla_gpu_enable_dynamic_slice_fusion" not in derived.xla_options(cfg)  # "auto", not resolved
    assert derived.xla_options(cfg, "pallas")["xla_gpu_enable_dynamic_slice_fusion"] is False  # auto -> pallas
    assert "xla_gpu_enable_dynamic_slice_fusion" not in derived.xla_options(cfg, "xla")
    cfg.model.lora_gemm = "pallas"
    assert derived.xla_options(cfg)["xla_gpu_enable_dynamic_slice_fusion"] is False
    cfg.train.xla_options = {"xla_gpu_enable_dynamic_slice_fusion": True}
    assert derived.xla_options(cfg)["xla_gpu_enable_dynamic_slice_fusion"] is True


def test_auto_picks_the_fused_gemm_only_where_it_runs_and_pays():
    """model.lora_gemm=auto (the recipe's): pallas for unrolled blocks in bf16 on H100/H200s with rows that tile
    the kernel or nearly (padding them adds at most 1/16); each condition that fails is named, and "xla" or "pallas"
    set in the config is kept."""
    from jaxflow.config import plan as plan_lib
    from jaxflow.config import validation as config_lib
    from jaxflow.config.recipes import base, tiny

    cfg = base()
    assert (cfg.model.lora_gemm, cfg.model.scan_unroll) == ("auto", 0)
    fits = dict(num_layers=60, devices=1, on_hopper=True, micro_batch=4, tokens=(1024, 96))
    assert plan_lib.lora_gemm(cfg, **fits)[0] == "pallas"
    cfg.model.scan_unroll = 60
    assert plan_lib.lora_gemm(cfg, **{**fits, "devices": 2})[0] == "pallas"  # data parallel: rows split
    cfg.sharding.fsdp = 2
    assert "2 devices with the weights sharded" in plan_lib.lora_gemm(cfg, **{**fits, "devices": 2})[1]
    cfg.sharding.fsdp = 1
    for nearly in (dict(micro_batch=2), dict(micro_batch=2, devices=2)):  # rows 2048 and 192: 64 padded, +2.9%
        assert plan_lib.lora_gemm(cfg, **{**fits, **nearly})[0] == "pallas"
    for change, reason in ((dict(num_layers=61), "scan"), (dict(on_hopper=False), "H100/H200"),
                           (dict(micro_batch=1, tokens=(64, 96)),
                            "rows [64, 96] padded to 128-row tiles would add 60% (over 1/16; model.lora_gemm=pallas"),
                           (dict(micro_batch=1, tokens=(512, 200)), "would add 8%")):
        gemm, why = plan_lib.lora_gemm(cfg, **{**fits, **change})
        assert gemm == "xla" and reason in why, (change, why)
    cfg.model.dtype = "float32"
    assert "float32 compute" in plan_lib.lora_gemm(cfg, **fits)[1]
    cfg.model.dtype, cfg.lora.rank = "bfloat16", 40
    assert "rank 40" in plan_lib.lora_gemm(cfg, **fits)[1]
    for fixed in ("xla", "pallas"):
        cfg.model.lora_gemm = fixed
        assert plan_lib.lora_gemm(cfg, **{**fits, "on_hopper": fixed == "xla"}) == (fixed, "set in the config")
    cfg = tiny(base())
    cfg.model.lora_gemm = "triton"
    with pytest.raises(config_lib.UserError, match=r"model.lora_gemm.*'auto', 'xla', 'pallas'"):
        config_lib.validate(cfg)
    with pytest.raises(ValueError, match="resolved first"):
        derived.model_options(base(), None, 60)


def test_scan_unroll_zero_follows_the_resolved_gemm():
    """model.scan_unroll=0 (the recipe's): the blocks unrolled where the linears run the fused kernel, a scan with
    XLA's (unrolled, those hold about twice the update's temporaries); a number set in the config is kept."""
    from jaxflow.config.recipes import base

    cfg = base()
    assert derived.model_options(cfg, "pallas", 60).scan_unroll == 60
    assert derived.model_options(cfg, "xla", 60).scan_unroll == 1
    cfg.model.scan_unroll = 7
    assert [derived.model_options(cfg, g, 60).scan_unroll for g in ("pallas", "xla")] == [7, 7]


def _split_rows_check():
    """Run in a subprocess with 2 forced CPU devices: one data-parallel train step with the fused kernel's rows
    split over the devices (`split_rows`, the kernel's XLA stand-in) equals the step with XLA's linears; without the
    split the fused path is refused."""
    import dataclasses

    from jaxflow.trainer import sharding as S
    from jaxflow.nn import lora_gemm
    from jaxflow.families.qwen_image import transformer
    from jaxflow.nn.lora import LoRAParam
    from jaxflow.trainer.step_config import TrainConfig
    from jaxflow.trainer.train_step import make_train_step
    from tests.helpers import random_window_batch

    assert jax.device_count() == 2
    real_matmul = lora_gemm.lora_matmul
    lora_gemm.lora_matmul = xla_matmul  # the Hopper kernel's stand-in, in this subprocess only
    transformer.check_available = lambda dtype: None
    cfg = QwenImageConfig(num_layers=2, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=64,
                          axes_dims_rope=(8, 12, 12))
    spec = LoRASpec(rank=4, alpha=8.0, targets=("to_q", "to_v", "img_mlp.net.2", "txt_mlp.net.0.proj"))
    model = QwenImageTransformer(cfg, ModelOptions(remat="save_matmuls"), spec, rngs=nnx.Rngs(0))
    leaves, treedef = jax.tree.flatten(nnx.state(model, LoRAParam))  # non-zero B: every LoRA param gets a gradient
    nnx.update(model, jax.tree.unflatten(
        treedef, [x + 0.1 * jax.random.normal(jax.random.key(i), x.shape) for i, x in enumerate(leaves)]))
    batch = random_window_batch(8)
    config = TrainConfig(guidance=1.0, grid_hw=(2, 2), num_micro_batches=2, clip_range=1e-2)
    layout = S.Layout.create(S.ShardingConfig())
    assert layout.batch_devices == 2
    fused = nnx.clone(model)
    fused.opts = dataclasses.replace(fused.opts, lora_gemm="pallas")
    init_state, step = make_train_step(fused, config, layout)
    with pytest.raises(ValueError, match="rows split"):
        step(init_state(), batch)
    fused.split_rows(layout.mesh, layout.batch_axes)
    unrolled = nnx.clone(fused)  # the recipe's form: the blocks unrolled with the fused kernel
    unrolled.opts = dataclasses.replace(unrolled.opts, scan_unroll=cfg.num_layers)
    results = {}
    for name, m in (("xla", model), ("fused", fused)):
        init_state, step = make_train_step(m, config, layout)
        state, metrics = step(init_state(), batch)
        assert int(metrics["skipped"]) == 0
        results[name] = (float(metrics["grad_norm"]), jax.tree.map(np.asarray, state.lora))
    # the blocks unrolled (the recipe's form) through lora_matmul itself, its rows padded to whole tiles (each
    # device's 2 samples x 4 image and 5 text tokens: 128), over a stand-in kernel that refuses rows that do not
    # tile; the toy's N and K are left unchecked
    kernel_rows = []

    def kernel_call(m, n, dtype, transposed, has_bias, tiling):
        def run(x, w, u, v, b):
            assert x.shape[0] == u.shape[0] == m and m % tiling.tile_m == 0, (x.shape, u.shape, m)
            kernel_rows.append(m)
            return xla_matmul(x, w, u, v, b if has_bias else None, transposed=transposed)
        return run

    lora_gemm.lora_matmul, lora_gemm._kernel_call = real_matmul, kernel_call
    lora_gemm.check_shapes = lambda x, w, u, v, bias, transposed, t: (
        x.shape[0], x.shape[1], (v if transposed else v.T).shape[0], u.shape[1])
    init_state, step = make_train_step(unrolled, config, layout)
    state, metrics = step(init_state(), batch)
    assert int(metrics["skipped"]) == 0 and set(kernel_rows) == {128}, kernel_rows
    results["fused_padded"] = (float(metrics["grad_norm"]), jax.tree.map(np.asarray, state.lora))
    lora_gemm.lora_matmul = xla_matmul
    norm_x, lora_x = results["xla"]
    for name in ("fused", "fused_padded"):
        norm_f, lora_f = results[name]
        assert abs(norm_f - norm_x) <= 1e-5 * norm_x, (name, norm_f, norm_x)
        for got, want in zip(jax.tree.leaves(lora_f), jax.tree.leaves(lora_x)):
            np.testing.assert_allclose(got, want, atol=1e-6, rtol=0, err_msg=name)
    rows = []  # the rows each call of the kernel is handed: one device's share

    def recording(x, *args, **kw):
        rows.append(x.shape[0])
        return xla_matmul(x, *args, **kw)

    split = lora_gemm.split_rows(recording, layout.mesh, layout.batch_axes)
    jax.jit(split).lower(*(jnp.zeros(s) for s in ((8, 16), (16, 12), (8, 4), (4, 12))))
    assert rows == [4], rows
    print("SPLIT_ROWS_OK")


@pytest.mark.slow
def test_split_rows_runs_the_fused_kernel_data_parallel():
    """model.lora_gemm=pallas on 2 devices: each device runs the kernel (here its XLA stand-in) on its own rows; the
    data-parallel step equals XLA's linears' within float32 rounding."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    code = "import tests.families.qwen_image.test_lora_gemm as t; t._split_rows_check()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=HANG_S)
    assert proc.returncode == 0 and "SPLIT_ROWS_OK" in proc.stdout, proc.stdout + proc.stderr[-5000:]
