"""The blocks unrolled (model.scan_unroll >= the blocks): the scan's gradient, remat kept per block, and each
block's frozen weights held as arrays of their own (unstack_blocks) instead of slices of the stacks."""
import contextlib
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend.core import jaxprs_in_params

from jaxflow.families.qwen_image.config import QwenImageConfig
from jaxflow.nn.config import ModelOptions
from jaxflow.nn.lora import LoRAParam
from jaxflow.families.qwen_image.lora import QwenImageLoRASpec as LoRASpec
from jaxflow.families.qwen_image.transformer import QwenImageTransformer


@contextlib.contextmanager
def lowerings():
    """The names of the functions JAX lowers inside the block (a list, filled as they are lowered)."""
    lowered = []

    def listen(event, secs, **kw):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered.append(kw.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield lowered
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)

CFG = QwenImageConfig(num_layers=2, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=64,
                      axes_dims_rope=(8, 12, 12))


def _lora_model(unroll: int, cfg: QwenImageConfig = CFG):
    opts = ModelOptions(remat="save_matmuls", scan_unroll=unroll)
    return QwenImageTransformer(cfg, opts, LoRASpec(rank=4, alpha=8.0), rngs=nnx.Rngs(0))


def _lora_loss(model):
    graphdef, lora, frozen = nnx.split(model, LoRAParam, ...)
    x = jax.random.normal(jax.random.key(1), (2, 4, 64))
    txt = jax.random.normal(jax.random.key(2), (2, 3, 64))

    def loss(lora, frozen):
        return jnp.sum(nnx.merge(graphdef, lora, frozen)(x, jnp.full((2,), 0.5), txt, None, (2, 2)) ** 2)
    return loss, lora, frozen


def _flat_grad(model):
    loss, lora, frozen = _lora_loss(model)
    return jnp.concatenate([g.ravel() for g in jax.tree.leaves(jax.jit(jax.grad(loss))(lora, frozen))])


def _close(a, b):
    # the same float32 ops, looped, unrolled or on other buffers: equal up to fusion-order rounding
    assert float(jnp.max(jnp.abs(a))) > 0
    assert jnp.allclose(a, b, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(a))))


def _unstacked(model):
    model.unstack_blocks()
    return model


@pytest.mark.slow
def test_the_unrolled_blocks_give_the_scan_s_gradient():
    scan = _flat_grad(_lora_model(1))
    _close(scan, _flat_grad(_lora_model(2)))
    _close(scan, _flat_grad(_unstacked(_lora_model(2))))


def test_the_unrolled_blocks_keep_their_remat_and_slice_their_weights_inside_it():
    # no loop between forward and backward: without barriers XLA's CSE merges the recompute into the forward (a
    # 12-block H200 run kept 27.1 GiB against 16.8); and a block's weights sliced outside its checkpoint are kept
    # from the forward to the backward (there: +0.53 GiB a block), so each checkpoint takes the whole stacks
    loss, lora, frozen = _lora_loss(_lora_model(2))
    lowered = jax.jit(jax.grad(loss)).lower(lora, frozen).as_text()
    assert "stablehlo.while" not in lowered and "optimization_barrier" in lowered
    blocks = [e for e in _eqns(jax.make_jaxpr(loss)(lora, frozen).jaxpr)
              if e.primitive.name in ("checkpoint", "remat", "remat2")]
    shapes = {tuple(v.aval.shape) for e in blocks for v in e.invars}
    assert len(blocks) == CFG.num_layers
    mlp_in = (CFG.inner_dim, CFG.mlp_dim)  # one block's img_mlp_in kernel
    assert (CFG.num_layers, *mlp_in) in shapes and mlp_in not in shapes


def _eqns(jaxpr):
    """Every equation of `jaxpr`, those of its sub-jaxprs (the checkpoints) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


def test_per_block_weights_are_read_in_place_not_sliced_from_stacks():
    # a slice of a stack, even at a static offset, is a copy before each matmul (23 ms a step at 12 blocks on an
    # H200): held one array per block, no frozen stack is left to slice, and the jitted step takes the pieces
    stacked, unstacked = _lora_model(2), _unstacked(_lora_model(2))
    frozen_stacks = {tuple(v.shape) for v in jax.tree.leaves(nnx.state(stacked.blocks, nnx.Not(LoRAParam)))}
    for model, sliced in ((stacked, True), (unstacked, False)):
        loss, lora, frozen = _lora_loss(model)
        shapes = {tuple(e.invars[0].aval.shape) for e in _eqns(jax.make_jaxpr(loss)(lora, frozen).jaxpr)
                  if e.primitive.name in ("slice", "dynamic_slice", "squeeze", "gather")}
        assert bool(shapes & frozen_stacks) == sliced, (sliced, shapes & frozen_stacks)
    stacks = jax.tree.leaves(nnx.state(stacked.blocks, nnx.Not(LoRAParam)))
    assert len(jax.tree.leaves(nnx.state(unstacked.blocks, nnx.Not(LoRAParam)))) == CFG.num_layers * len(stacks)
    assert unstacked.blocks_unstacked and not stacked.blocks_unstacked
    # the LoRA stays stacked: its optimizer state and export are per stack
    assert all(v.shape[0] == CFG.num_layers for v in jax.tree.leaves(nnx.state(unstacked.blocks, LoRAParam)))


@pytest.mark.slow
def test_the_lora_gradient_of_unrolled_blocks_is_not_a_sum_of_padded_stacks():
    # a block's LoRA taken by its own slice has for gradient the whole stack zero-padded, and the stack's gradient
    # is the sum of one such per block: traffic growing with the blocks squared (at 60 blocks on an H200, ~0.4 s
    # a step of fusions outside the blocks' scopes). One split per stack has a concatenate for gradient instead.
    three = dataclasses.replace(CFG, num_layers=3)  # stacks (3, ...): no activation (2, ...) has their shape
    loss, lora, frozen = _lora_loss(_unstacked(_lora_model(3, three)))
    stacks = {tuple(v.shape) for v in jax.tree.leaves(lora)}
    grad = jax.make_jaxpr(jax.grad(loss))(lora, frozen).jaxpr
    ops = [(e.primitive.name, tuple(e.outvars[0].aval.shape)) for e in _eqns(grad)
           if e.primitive.name in ("pad", "add_any", "concatenate")]
    assert not [op for op in ops if op[0] in ("pad", "add_any") and op[1] in stacks]
    assert {op[1] for op in ops if op[0] == "concatenate"} >= stacks


def test_the_unrolled_blocks_are_traced_once_not_once_a_block(monkeypatch):
    # each block is one call of the same jitted (and checkpointed) program: its Python runs once however many blocks
    # there are, so the recipe's 60 blocks trace and differentiate as fast as one (a block's tracing was most of the
    # step's start-up trace); the gradient matches the scan's (test_the_unrolled_blocks_give_the_scan_s_gradient)
    from jaxflow.families.qwen_image import transformer

    calls = []
    real = transformer.Block.__call__
    monkeypatch.setattr(transformer.Block, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    for unstack in (False, True):
        three = dataclasses.replace(CFG, num_layers=3)
        model = _lora_model(3, three)
        loss, lora, frozen = _lora_loss(_unstacked(model) if unstack else model)
        calls.clear()
        jax.make_jaxpr(jax.grad(loss))(lora, frozen)
        assert len(calls) == 1, (unstack, len(calls))


def test_per_block_weights_are_refused_where_a_scan_would_read_them():
    with pytest.raises(ValueError, match="scan_unroll >= 2"):
        _lora_model(1).unstack_blocks()
    model = _unstacked(_lora_model(2))
    model.opts = dataclasses.replace(model.opts, scan_unroll=1)
    with pytest.raises(ValueError, match="run them unrolled"):
        model(jnp.zeros((1, 4, 64)), jnp.full((1,), 0.5), jnp.zeros((1, 3, 64)), None, (2, 2))


def test_per_block_weights_keep_the_fingerprint_and_the_export():
    from jaxflow.families.qwen_image.loading import fingerprint, to_diffusers_state_dict
    model = _lora_model(2)
    leaves, treedef = jax.tree.flatten(nnx.state(model, LoRAParam))  # non-zero B: the merge changes the kernels
    nnx.update(model, jax.tree.unflatten(treedef, [x + 0.1 for x in leaves]))
    before = fingerprint(model), to_diffusers_state_dict(model), to_diffusers_state_dict(model, merge_lora=True)
    model.unstack_blocks()
    after = fingerprint(model), to_diffusers_state_dict(model), to_diffusers_state_dict(model, merge_lora=True)
    assert before[0] == after[0]
    for want, got in zip(before[1:], after[1:]):
        assert want.keys() == got.keys()
        for key in want:
            np.testing.assert_array_equal(want[key], got[key], err_msg=key)


def test_each_stack_is_cut_in_one_program():
    """unstack_blocks lowers one program per stack shape (three blocks: shapes no other test cuts, so nothing is
    compiled already), where slicing each piece eagerly lowered two (a slice and a squeeze); the pieces are the
    stack's. The model is abstract with random frozen weights put from the host (drawing them compiles)."""
    cfg, opts = dataclasses.replace(CFG, num_layers=3), ModelOptions(scan_unroll=3)
    model = nnx.eval_shape(lambda: QwenImageTransformer(cfg, opts, LoRASpec(rank=4, alpha=8.0), rngs=nnx.Rngs(0)))
    rng, stacks = np.random.default_rng(0), {}
    for path, var in nnx.iter_graph(model.blocks):
        if isinstance(var, nnx.Param) and not isinstance(var, LoRAParam):
            stacks[path] = rng.standard_normal(var.shape).astype(var.dtype)
            var.set_value(jax.device_put(stacks[path]))
    with lowerings() as lowered:
        model.unstack_blocks()
    assert len(lowered) <= len({(s.shape, s.dtype) for s in stacks.values()}), lowered
    pieces = {p: v.get_value() for p, v in nnx.iter_graph(model.blocks) if p in stacks}
    for p, stack in stacks.items():
        assert len(pieces[p]) == 3
        for i, piece in enumerate(pieces[p]):
            np.testing.assert_array_equal(np.asarray(piece), stack[i])


def test_a_running_model_unrolls_through_the_host_its_stacks_freed_first():
    """`unroll` (model.unroll_upgrade's swap) copies every stack to the host and frees them all before the pieces
    go back, so that the pieces fill the stacks' place together: each stack is deleted, the pieces are its rows
    and carry its sharding less the stack's axis, and the model keeps its fingerprint and its LoRA stacks."""
    from jaxflow.families.qwen_image.loading import fingerprint
    model = _lora_model(1)
    stacks = {p: v.get_value() for p, v in nnx.iter_graph(model.blocks)
              if isinstance(v, nnx.Variable) and not isinstance(v, LoRAParam)}
    rows = {p: np.asarray(stack) for p, stack in stacks.items()}
    lora = jax.tree.map(np.asarray, nnx.state(model, LoRAParam))
    before = fingerprint(model)
    model.unroll(dataclasses.replace(model.opts, scan_unroll=2))
    assert model.unrolled and model.blocks_unstacked
    pieces = {p: v.get_value() for p, v in nnx.iter_graph(model.blocks) if p in stacks}
    for p, stack in stacks.items():
        assert stack.is_deleted(), p
        assert len(pieces[p]) == 2 and all(piece.sharding.is_equivalent_to(stack.sharding, piece.ndim)
                                           for piece in pieces[p]), p
        for i, piece in enumerate(pieces[p]):
            np.testing.assert_array_equal(np.asarray(piece), rows[p][i], err_msg=str(p))
    assert fingerprint(model) == before
    jax.tree.map(np.testing.assert_array_equal, lora, jax.tree.map(np.asarray, nnx.state(model, LoRAParam)))


@pytest.mark.parametrize("unroll", [1, 2])
def test_the_fingerprint_is_the_folder_s_and_reads_every_head_in_one_program(tiny_path, unroll):
    """Stacked (a scan) or per block, the trainer's fingerprint of the tiny folder's weights is the one the rollout
    computes from the folder, and it lowers one program (slicing each tensor eagerly lowered one per shape: 20)."""
    from jaxflow.families.qwen_image.loading import fingerprint, load_transformer
    from jaxflow_bridge.rollout.fingerprint import stored_fingerprint
    model = load_transformer(tiny_path / "transformer", ModelOptions(scan_unroll=unroll))
    if model.unrolled:
        model.unstack_blocks()
    with lowerings() as lowered:
        mine = fingerprint(model)
    assert mine == stored_fingerprint(tiny_path / "transformer")
    assert len(lowered) <= 1, lowered


def test_the_trainer_holds_unrolled_blocks_weights_per_block(tmp_path):
    from jaxflow.trainer.learner import build_model
    from jaxflow.config.recipes import base, tiny
    from jaxflow.trainer.sharding import Layout, ShardingConfig
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(CFG.to_dict()))
    cfg = tiny(base())
    cfg.model.init = "random"
    cfg.model.scan_unroll = CFG.num_layers  # (with a scan they stay stacked, or every scan training test fails)
    model = build_model(cfg, tmp_path, LoRASpec(rank=4, alpha=8.0), Layout.create(ShardingConfig()))
    assert model.blocks_unstacked
