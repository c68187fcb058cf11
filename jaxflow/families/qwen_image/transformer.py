"""Flax NNX Qwen-Image transformer (QwenImageTransformer2DModel), blocks stacked and run with a scan or unrolled."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec

from jaxflow.nn.attention import attention, resolve_implementation
from jaxflow.families.qwen_image.config import QwenImageConfig
from jaxflow.nn.config import ModelOptions
from jaxflow.nn.embeddings import TIMESTEP_CHANNELS, apply_rope, inv_freq, rope_angles, rope_tables, timestep_embedding
from jaxflow.nn.layers import Linear, RMSNorm, gelu_tanh, layer_norm
from jaxflow.nn.lora import LoRAParam, LoRASpec
from jaxflow.nn import lora_gemm
from jaxflow.nn.lora_gemm import check_available, check_partitioned, split_rows

# The cuDNN attention's forward primitive: its outputs are the attention output and the softmax statistics.
CUDNN_ATTENTION_FWD = "dot_product_attention_fwd_wrapper"
_SAVE_QKV_MLP = jax.checkpoint_policies.save_only_these_names("qkv", "mlp_hidden")


def _save_matmuls_stats(prim, *args, **params) -> bool:
    """save_matmuls for the cuDNN attention: q/k/v and the MLP hidden by name, and both outputs of the fused
    attention forward (its output and the softmax statistics its backward needs), so the backward never runs the
    attention forward again (`attn_out`, a reshape of that output, is not saved twice)."""
    return prim.name == CUDNN_ATTENTION_FWD or _SAVE_QKV_MLP(prim, *args, **params)


_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_attn": jax.checkpoint_policies.save_only_these_names("attn_out"),
    # Save every large matmul output the backward needs (q/k/v, attention output, MLP hidden); the recompute
    # is then elementwise work only (norms, modulation, RoPE, GELU) plus the small LoRA products.
    "save_matmuls": jax.checkpoint_policies.save_only_these_names("qkv", "attn_out", "mlp_hidden"),
    "save_matmuls_stats": _save_matmuls_stats,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def remat_policy(name: str, attention_impl: str):
    """The jax.checkpoint policy named `name` (ModelOptions.remat) for blocks running `attention_impl`."""
    if name == "save_matmuls_stats" and attention_impl != "cudnn":
        raise ValueError(f"model.remat=save_matmuls_stats saves the cuDNN attention's softmax statistics, but the "
                         f"attention runs {attention_impl!r}: use model.remat=save_matmuls (or cuDNN: bf16 on a GPU)")
    return _POLICIES[name]


def image_rope_angles(grids: tuple[tuple[int, int], ...], txt_len: int, axes_dims: tuple[int, int, int]):
    """Rotation angles of several images' tokens, concatenated (image k at frame position k, its rows and columns
    centred as `rope_angles`'), and of the text after them, at the largest image's offset: diffusers' `QwenEmbedRope`
    over `img_shapes` [(1, h0, w0), (1, h1, w1), ...] (the edit model's target and reference images). One image is
    `rope_angles`."""
    angles = []
    for k, (h, w) in enumerate(grids):
        img, _ = rope_angles(h, w, 0, axes_dims)
        if k:  # the frame axis' first axes_dims[0] / 2 angles: position k
            img[:, : axes_dims[0] // 2] = np.float32(k) * inv_freq(axes_dims[0])
        angles.append(img)
    widest = max(grids, key=lambda g: max(g[0] // 2, g[1] // 2))
    return np.concatenate(angles), rope_angles(*widest, txt_len, axes_dims)[1]


def _modulate(x, shift, scale):
    return x * (1 + scale[:, None]) + shift[:, None]


class _Factory:
    """Creates the Linear/RMSNorm layers of one model with its dtypes and LoRA targets."""

    def __init__(self, opts: ModelOptions, lora: LoRASpec | None, rngs: nnx.Rngs):
        self.opts, self.rngs = opts, rngs
        self.lora, self.lora_paths = lora, (lora.target_paths() if lora else set())

    def linear(self, din, dout, axes, path=None):
        spec = self.lora if path in self.lora_paths else None
        return Linear(din, dout, axes=axes, dtype=self.opts.compute_dtype, param_dtype=self.opts.storage_dtype,
                      rngs=self.rngs, lora=spec)

    def rms(self, dim, axis_name):
        return RMSNorm(dim, axis_name=axis_name, dtype=self.opts.compute_dtype, param_dtype=self.opts.storage_dtype)


class JointAttention(nnx.Module):
    """Image (to_*) and text (add_*) projections, per-head RMS q/k norms, RoPE, one joint attention."""

    def __init__(self, cfg: QwenImageConfig, make: _Factory):
        d, hd = cfg.inner_dim, cfg.attention_head_dim
        self.heads, self.head_dim = cfg.num_attention_heads, hd
        for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            setattr(self, name, make.linear(d, d, ("embed", "heads"), ("attn", name)))
        self.to_out = make.linear(d, d, ("heads", "embed"), ("attn", "to_out"))
        self.to_add_out = make.linear(d, d, ("heads", "embed"), ("attn", "to_add_out"))
        for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            setattr(self, name, make.rms(hd, "head_dim"))

    def _heads(self, x):
        return x.reshape(*x.shape[:-1], self.heads, self.head_dim)

    def __call__(self, img, txt, rope, kv_len, impl, lora_scale, gemm):
        img_cos, img_sin, txt_cos, txt_sin = rope
        proj = lambda layer, x: checkpoint_name(self._heads(layer(x, lora_scale, gemm)), "qkv")  # noqa: E731
        qi = apply_rope(self.norm_q(proj(self.to_q, img)), img_cos, img_sin)
        ki = apply_rope(self.norm_k(proj(self.to_k, img)), img_cos, img_sin)
        vi = proj(self.to_v, img)
        qt = apply_rope(self.norm_added_q(proj(self.add_q_proj, txt)), txt_cos, txt_sin)
        kt = apply_rope(self.norm_added_k(proj(self.add_k_proj, txt)), txt_cos, txt_sin)
        vt = proj(self.add_v_proj, txt)
        # Joint order [image, text]: the masked keys (text padding) form a suffix, so a length mask suffices.
        q, k, v = (jnp.concatenate(p, axis=1) for p in ((qi, qt), (ki, kt), (vi, vt)))
        o = attention(q, k, v, kv_len, impl)
        o = checkpoint_name(o.reshape(*o.shape[:2], -1), "attn_out")
        n = img.shape[1]
        return self.to_out(o[:, :n], lora_scale, gemm), self.to_add_out(o[:, n:], lora_scale, gemm)


class Block(nnx.Module):
    """Dual-stream block: modulation chunks [shift1, scale1, gate1, shift2, scale2, gate2] per stream."""

    def __init__(self, cfg: QwenImageConfig, make: _Factory):
        d, m = cfg.inner_dim, cfg.mlp_dim
        self.img_mod = make.linear(d, 6 * d, ("embed", "mod"), ("img_mod",))
        self.txt_mod = make.linear(d, 6 * d, ("embed", "mod"), ("txt_mod",))
        self.attn = JointAttention(cfg, make)
        self.img_mlp_in = make.linear(d, m, ("embed", "mlp"), ("img_mlp_in",))
        self.img_mlp_out = make.linear(m, d, ("mlp", "embed"), ("img_mlp_out",))
        self.txt_mlp_in = make.linear(d, m, ("embed", "mlp"), ("txt_mlp_in",))
        self.txt_mlp_out = make.linear(m, d, ("mlp", "embed"), ("txt_mlp_out",))

    def __call__(self, img, txt, temb, rope, kv_len, impl, lora_scale, gemm):
        """gemm (ModelOptions.lora_gemm) runs the token-wise linears; the modulation (one row per sample) is XLA's."""
        # named scopes: profiles (the `profile` config section) group the block's ops under these names
        with jax.named_scope("modulation"):
            act = jax.nn.silu(temb)
            ish1, isc1, ig1, ish2, isc2, ig2 = jnp.split(self.img_mod(act, lora_scale), 6, axis=-1)
            tsh1, tsc1, tg1, tsh2, tsc2, tg2 = jnp.split(self.txt_mod(act, lora_scale), 6, axis=-1)
        with jax.named_scope("attention"):
            ai, at = self.attn(_modulate(layer_norm(img), ish1, isc1), _modulate(layer_norm(txt), tsh1, tsc1),
                               rope, kv_len, impl, lora_scale, gemm)
            img = img + ig1[:, None] * ai
            txt = txt + tg1[:, None] * at
        with jax.named_scope("mlp"):
            hi = gelu_tanh(checkpoint_name(self.img_mlp_in(_modulate(layer_norm(img), ish2, isc2), lora_scale, gemm),
                                           "mlp_hidden"))
            img = img + ig2[:, None] * self.img_mlp_out(hi, lora_scale, gemm)
            ht = gelu_tanh(checkpoint_name(self.txt_mlp_in(_modulate(layer_norm(txt), tsh2, tsc2), lora_scale, gemm),
                                           "mlp_hidden"))
            txt = txt + tg2[:, None] * self.txt_mlp_out(ht, lora_scale, gemm)
        if img.dtype == jnp.float16:
            img, txt = jnp.clip(img, -65504, 65504), jnp.clip(txt, -65504, 65504)
        return img, txt


class QwenImageTransformer(nnx.Module):
    """v = model(x, sigma, txt, txt_mask, grid_hw): packed latents (B, h*w, 64) -> velocity (B, h*w, 64)."""

    def __init__(self, cfg: QwenImageConfig, opts: ModelOptions = ModelOptions(), lora: LoRASpec | None = None,
                 *, rngs: nnx.Rngs):
        self.cfg, self.opts, self.lora_spec = cfg, opts, lora
        self.row_split = None  # (mesh, batch axes) the fused kernel's rows are split over (`split_rows`)
        self.impl = resolve_implementation(opts.attention, opts.dtype)
        if opts.remat != "none":
            remat_policy(opts.remat, self.impl)  # refused at build, not at the first trace
        if opts.lora_gemm == "pallas":
            check_available(opts.dtype)
        make = _Factory(opts, lora, rngs)
        d = cfg.inner_dim
        self.img_in = make.linear(cfg.in_channels, d, ("latent", "embed"))
        self.txt_norm = make.rms(cfg.joint_attention_dim, "text_embed")
        self.txt_in = make.linear(cfg.joint_attention_dim, d, ("text_embed", "embed"))
        self.time_linear_1 = make.linear(TIMESTEP_CHANNELS, d, (None, "embed"))
        self.time_linear_2 = make.linear(d, d, ("embed", "embed_out"))
        self.norm_out = make.linear(d, 2 * d, ("embed", "mod"))
        self.proj_out = make.linear(d, cfg.patch_size ** 2 * cfg.out_channels, ("embed", "latent"))

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stack(rngs):
            return Block(cfg, _Factory(opts, lora, rngs))

        self.blocks = stack(rngs)

    @property
    def unrolled(self) -> bool:
        """Whether the blocks run as straight-line code (model.scan_unroll >= the blocks), not a lax.scan."""
        return self.opts.scan_unroll >= self.cfg.num_layers

    @property
    def blocks_unstacked(self) -> bool:
        """Whether the blocks' frozen weights are held one array per block (`unstack_blocks`)."""
        return any(isinstance(v.get_value(), tuple) for _, v in _frozen_variables(self.blocks))

    def split_rows(self, mesh, axes: tuple[str, ...]) -> None:
        """Run the fused LoRA kernel (model.lora_gemm=pallas) on every device's own rows, split over the mesh `axes`
        (the batch's, `jaxflow.trainer.sharding.Layout.batch_axes`): data parallelism with the kernel, which is itself not
        partitioned. The frozen weights should be whole on each device (replicated), as the default rules hold them."""
        self.row_split = (mesh, tuple(axes))

    def unstack_blocks(self, through_host: bool = False) -> None:
        """Hold each frozen block weight as one array per block instead of a (num_layers, ...) stack (the LoRA stays
        stacked), for unrolled blocks: a block then reads its weights in place, where a static slice of a stack is a
        copy (docs/design.md §2). One stack at a time is replaced by its pieces (peak memory: one stack more); each
        piece keeps the stack's sharding of its other axes; a stack is cut in one program (`_unstack`: one compile per
        stack shape, where each piece's eager slice compiled two). Only the unrolled blocks run on such a model.
        `through_host`: the stacks are copied to the host and freed, all of them, before the pieces go back (a
        running model's, `unroll`): the pieces then fill the stacks' place together, where one stack at a time
        leaves holes between them that a large buffer of the train step no longer fits in."""
        if not self.unrolled:
            raise ValueError(f"unstack_blocks needs unrolled blocks: model.scan_unroll={self.opts.scan_unroll} < "
                             f"{self.cfg.num_layers} blocks; set model.scan_unroll >= {self.cfg.num_layers}")
        values = [(var, var.get_value()) for _, var in _frozen_variables(self.blocks)]
        stacks = [(var, value) for var, value in values if not isinstance(value, tuple)]
        if through_host:  # one transfer call each way for all the arrays, which JAX runs concurrently
            shardings = [[_piece_sharding(stack.sharding)] * stack.shape[0] for _, stack in stacks]
            hosts = jax.device_get([stack for _, stack in stacks])
            for _, stack in stacks:
                stack.delete()
            for (var, _), pieces in zip(stacks, jax.device_put([list(host) for host in hosts], shardings)):
                var.set_value(tuple(pieces))
            return
        for var, stack in stacks:
            var.set_value(tuple(jax.device_put(piece, _piece_sharding(stack.sharding)) for piece in _unstack(stack)))

    def abstract_unrolled(self, opts: ModelOptions) -> QwenImageTransformer:
        """This model as it runs `opts` (unrolled blocks) after `unroll`, abstract: every array a ShapeDtypeStruct
        with its sharding (nothing copied), each frozen block weight one per block. A train step made from it
        compiles the unrolled program while this model still runs its own (model.unroll_upgrade)."""
        self._check_unrolled(opts)
        graphdef, state = nnx.split(self)
        abstract = nnx.merge(graphdef, jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), state))
        abstract.opts = opts
        for _, var in _frozen_variables(abstract.blocks):
            stack = var.get_value()
            if not isinstance(stack, tuple):
                piece = jax.ShapeDtypeStruct(stack.shape[1:], stack.dtype, sharding=_piece_sharding(stack.sharding))
                var.set_value((piece,) * stack.shape[0])
        return abstract

    def unroll(self, opts: ModelOptions) -> None:
        """Run `opts` (unrolled blocks) from now on, the frozen block weights unstacked (`unstack_blocks`); the LoRA
        keeps its stacks."""
        self._check_unrolled(opts)
        self.opts = opts
        self.unstack_blocks(through_host=True)

    def _check_unrolled(self, opts: ModelOptions) -> None:
        if opts.scan_unroll < self.cfg.num_layers:
            raise ValueError(f"ModelOptions.scan_unroll={opts.scan_unroll} does not unroll the {self.cfg.num_layers} "
                             f"blocks")
        if opts.lora_gemm == "pallas":
            check_available(opts.dtype)

    def __call__(self, x, sigma, txt, txt_mask, grid_hw: tuple[int, int], lora_scale: float | jax.Array = 1.0):
        """x (B, h*w, C_in); sigma (B,) in [0, 1]; txt (B, L, joint_dim); txt_mask (B, L) bool, right-padded
        (valid tokens first) or None; grid_hw = (h, w) static; lora_scale 0 = adapters off (the KL reference).
        Matmuls run at `opts.precision` (set while tracing, so it is part of the compiled step)."""
        with jax.default_matmul_precision(self.opts.precision):
            return self._forward(x, sigma, txt, txt_mask, (tuple(grid_hw),), lora_scale)

    def _forward(self, x, sigma, txt, txt_mask, grids, lora_scale):
        """x holds the tokens of every image of `grids` ((h, w) each, static), the first one's first; the
        velocity of the first image's tokens only (`image_rope_angles`: one image is the text-to-image model)."""
        dtype = self.opts.compute_dtype
        tokens = sum(h * w for h, w in grids)
        if x.shape[1] != tokens:
            raise ValueError(f"x has {x.shape[1]} tokens but the image grids {grids} give {tokens}")
        img = self.img_in(x)
        ctx = self.txt_in(self.txt_norm(txt.astype(dtype)))
        temb = self.time_linear_2(jax.nn.silu(self.time_linear_1(timestep_embedding(sigma, dtype))))
        img_ang, txt_ang = image_rope_angles(grids, txt.shape[1], self.cfg.axes_dims_rope)
        rope = (*rope_tables(img_ang), *rope_tables(txt_ang))
        if self.opts.rope_table_dtype == "bfloat16":
            rope = tuple(t.astype(jnp.bfloat16).astype(jnp.float32) for t in rope)
        kv_len = None if txt_mask is None else (tokens + jnp.sum(txt_mask, axis=-1)).astype(jnp.int32)
        img, ctx = self._blocks(img, ctx, temb, rope, kv_len, lora_scale)
        scale, shift = jnp.split(self.norm_out(jax.nn.silu(temb)), 2, axis=-1)
        target = grids[0][0] * grids[0][1]
        return self.proj_out(_modulate(layer_norm(img[:, :target]), shift, scale))

    def _blocks(self, img, ctx, temb, rope, kv_len, lora_scale):
        """The stacked blocks, remat policy by name: a lax.scan over them (compile time independent of depth), or
        a straight line when model.scan_unroll >= num_layers: each block one call of the same jitted program
        (traced once; XLA inlines the calls, so each block reads its weights at a constant offset, with no
        per-iteration dynamic slice of the stacks).

        A functional loop over the split block state rather than nnx.scan: under jax.grad wrt the LoRA params
        only, a block holds variables at two trace levels, which NNX's graph transforms refuse.
        """
        impl, remat = self.impl, self.opts.remat != "none"  # read at trace time: a changed `opts` takes effect
        policy = remat_policy(self.opts.remat, impl) if remat else None
        gemm = self.opts.lora_gemm
        if gemm == "pallas":
            check_available(self.opts.dtype)
            check_partitioned(self.row_split is not None)
            if self.row_split is not None:
                gemm = split_rows(lora_gemm.lora_matmul, *self.row_split)

        def block(carry, graphdef, *states):
            return nnx.merge(graphdef, *states)(*carry, temb, rope, kv_len, impl, lora_scale, gemm)

        if self.unrolled:
            graphdef, lora, frozen = nnx.split(self.blocks, LoRAParam, ...)
            stacked = jax.tree.map(lambda w: not _is_pieces(w), frozen, is_leaf=_is_pieces)

            def layer(carry, lora_i, weights, i, temb, rope, kv_len, lora_scale):
                # a stack's block is taken inside the checkpoint: a slice taken outside would be one of its inputs,
                # kept from the forward to the backward (a copy of every block's weights); i is an argument, so
                # every block is this one program, a constant index once XLA inlines the calls (a static slice).
                # Unstacked weights (one array per block) are picked outside, in place.
                frozen_i = jax.tree.map(lambda s, w: lax.dynamic_index_in_dim(w, i, keepdims=False) if s else w,
                                        stacked, weights)
                block_i = nnx.merge(graphdef, _squeezed(lora_i), frozen_i)
                return block_i(*carry, temb, rope, kv_len, impl, lora_scale, gemm)

            if remat:  # no loop between forward and backward: barriers keep XLA from merging the recompute into
                # the forward (which would keep every activation)
                layer = jax.checkpoint(layer, policy=policy, prevent_cse=True)
            layer = jax.jit(layer)  # traced (and differentiated) once for all the blocks, not once a block
            carry = (img, ctx)
            for i, lora_i in enumerate(_split_stacks(lora, self.cfg.num_layers)):
                weights = jax.tree.map(lambda w: w[i] if _is_pieces(w) else w, frozen, is_leaf=_is_pieces)
                carry = layer(carry, lora_i, weights, np.int32(i), temb, rope, kv_len, lora_scale)
            return carry

        if self.blocks_unstacked:
            raise ValueError(f"the blocks' weights are held one array per block (unstack_blocks): run them unrolled, "
                             f"model.scan_unroll >= {self.cfg.num_layers} (it is {self.opts.scan_unroll})")
        graphdef, state = nnx.split(self.blocks)

        def body(carry, layer):
            return block(carry, graphdef, layer), None

        if remat:  # inside the loop the recompute cannot be merged with the forward: no CSE barriers needed
            body = jax.checkpoint(body, policy=policy, prevent_cse=False)
        (img, ctx), _ = jax.lax.scan(body, (img, ctx), state, unroll=self.opts.scan_unroll)
        return img, ctx


def _frozen_variables(blocks: nnx.Module):
    """(path, variable) of the blocks' frozen (non-LoRA) weights."""
    return [(p, v) for p, v in nnx.iter_graph(blocks) if isinstance(v, nnx.Variable) and not isinstance(v, LoRAParam)]


def _piece_sharding(sharding):
    """A stack's sharding for one of its pieces: a NamedSharding without the stack's axis; another as it is."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
    return sharding


@jax.jit
def _unstack(stack) -> tuple:
    """The (n, ...) `stack`'s n pieces."""
    return tuple(stack[i] for i in range(stack.shape[0]))


def _split_stacks(tree, n: int) -> list:
    """`tree`'s (n, ...) stacks as n per-block trees of (1, ...) pieces, by one split per stack: its gradient is one
    concatenate, where n separate slices' gradients are n zero-padded whole stacks summed (traffic growing with n
    squared). The blocks' program drops the leading axis (`_squeezed`), once for all of them."""
    leaves, treedef = jax.tree.flatten(tree)
    parts = [lax.split(w, (1,) * n) for w in leaves]
    return [jax.tree.unflatten(treedef, [ps[i] for ps in parts]) for i in range(n)]


def _squeezed(tree):
    """A block's (1, ...) LoRA pieces (`_split_stacks`) as its weights."""
    return jax.tree.map(lambda w: lax.squeeze(w, (0,)), tree)


def _is_pieces(x) -> bool:
    """A frozen weight held one array per block (a tuple, `unstack_blocks`)."""
    return isinstance(x, tuple)
