"""BAGEL's generation path: the context prefill (understanding expert, causal) and the denoising forward of
[<|vision_start|>, latents, <|vision_end|>] over that context (docs/bagel.md §1)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxflow.nn.attention import resolve_implementation
from jaxflow.families.bagel.config import BagelConfig
from jaxflow.families.bagel.embeddings import latent_pos_table, latent_position_ids, rope_tables, timestep_embedding
from jaxflow.families.bagel.lora import expert_targets
from jaxflow.families.bagel.mot import Make, MoTLayer
from jaxflow.nn.config import ModelOptions
from jaxflow.nn.embeddings import TIMESTEP_CHANNELS
from jaxflow.nn.lora import LoRASpec

KVCache = tuple[jax.Array, jax.Array]  # keys, values: (layers, B, L, kv_heads, head_dim) after q/k norm and RoPE


class BagelModel(nnx.Module):
    """The weights the denoising forward reads: token embeddings (context and markers), the MoT layers (stacked
    for a scan), the generation expert's final norm, the timestep embedder, vae2llm / llm2vae and the latent 2-D
    position table. Not here: the LM head and the understanding expert's final norm (text logits only), ViT, VAE.
    `lora` (families/bagel/lora.BagelLoRASpec): adapters on the generation expert's targeted projections only."""

    def __init__(self, cfg: BagelConfig, opts: ModelOptions = ModelOptions(), lora: LoRASpec | None = None, *,
                 rngs: nnx.Rngs):
        self.cfg, self.opts, self.lora = cfg, opts, lora
        expert_targets(lora)  # an unknown target is refused here, by name
        self.impl = resolve_implementation(opts.attention, opts.dtype)
        make = Make(opts, rngs, cfg.rms_norm_eps)
        d = cfg.hidden_size
        emb = jax.random.normal(rngs.params(), (cfg.vocab_size, d), jnp.float32)
        self.embed_tokens = nnx.Param(emb.astype(opts.storage_dtype), logical_axes=("vocab", "embed"))
        self.norm_moe_gen = make.rms(d, "embed")
        self.time_embedder_1 = make.linear(TIMESTEP_CHANNELS, d, (None, "embed"))
        self.time_embedder_2 = make.linear(d, d, ("embed", "embed_out"))
        self.vae2llm = make.linear(cfg.latent_dim, d, ("latent", "embed"))
        self.llm2vae = make.linear(d, cfg.latent_dim, ("embed", "latent"))
        table = latent_pos_table(cfg.max_latent_size, d)
        self.latent_pos_embed = nnx.Param(jnp.asarray(table, opts.storage_dtype), logical_axes=(None, "embed"))

        @nnx.split_rngs(splits=cfg.num_hidden_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stack(rngs):
            return MoTLayer(cfg, Make(opts, rngs, cfg.rms_norm_eps), lora)

        self.layers = stack(rngs)

    def _embed(self, ids):
        return jnp.take(self.embed_tokens[...], ids, axis=0).astype(self.opts.compute_dtype)

    def _layers(self, h, is_gen, cos, sin, past: KVCache | None, kv_len, causal, lora_scale=1.0):
        """The layers as a lax.scan over their stacked state (and the cache's layer axis); returns h and every
        layer's (k, v) of the tokens, stacked."""
        graphdef, state = nnx.split(self.layers)

        def body(h, xs):
            layer_state, layer_past = xs
            return nnx.merge(graphdef, layer_state)(h, is_gen, cos, sin, layer_past, kv_len, causal, self.impl,
                                                    lora_scale)

        return jax.lax.scan(body, h, (state, past))

    def prefill(self, context_ids: jax.Array) -> KVCache:
        """Every layer's K/V of the right-padded context (B, L): understanding expert, causal, token j at RoPE
        position j. Needs no mask: a valid token's keys all precede it; `denoise` masks the padded rows."""
        with jax.default_matmul_precision(self.opts.precision):
            length = context_ids.shape[1]
            cos, sin = rope_tables(length, self.cfg.head_dim, self.cfg.rope_theta)
            _, kv = self._layers(self._embed(context_ids), np.zeros(length, bool), cos[None], sin[None], None,
                                 None, True)
        return kv

    def denoise(self, context_kv: KVCache, context_mask: jax.Array, latents: jax.Array, t: jax.Array,
                grid_hw: tuple[int, int], lora_scale: jax.Array | float = 1.0) -> jax.Array:
        """Velocity (B, S, latent_dim) of the latents (B, S, latent_dim) at sigma t (B,) over a prefilled context;
        lora_scale multiplies the adapters' contribution (0: the base weights, FlowGRPO's KL reference).

        Query [<|vision_start|>, latents (row-major h x w = grid_hw), <|vision_end|>], every token at RoPE position
        context_mask.sum() (0 for an empty context); latent token = vae2llm(x) + time_embedder(t) +
        latent_pos_embed[r * max_latent_size + c]. Markers run the understanding expert, latents the generation
        expert; every query token sees the valid context and every query token (no causal mask).
        """
        cfg = self.cfg
        h_, w_ = grid_hw
        if latents.shape[1] != h_ * w_:
            raise ValueError(f"latents have {latents.shape[1]} tokens but grid_hw={grid_hw} gives {h_ * w_}")
        with jax.default_matmul_precision(self.opts.precision):
            dtype, batch = self.opts.compute_dtype, latents.shape[0]
            temb = self.time_embedder_2(jax.nn.silu(self.time_embedder_1(timestep_embedding(t, dtype))))
            pos = jnp.take(self.latent_pos_embed[...], latent_position_ids(h_, w_, cfg.max_latent_size), axis=0)
            x = self.vae2llm(latents) + temb[:, None] + pos.astype(dtype)[None]
            markers = self._embed(jnp.array([cfg.vision_start_id, cfg.vision_end_id]))
            start, end = (jnp.broadcast_to(m, (batch, 1, m.shape[-1])) for m in (markers[:1], markers[1:]))
            h = jnp.concatenate([start, x, end], axis=1)
            is_gen = np.zeros(h_ * w_ + 2, bool)
            is_gen[1:-1] = True
            ctx_len = jnp.sum(context_mask, axis=-1).astype(jnp.int32)
            cos, sin = rope_tables(context_mask.shape[1] + 1, cfg.head_dim, cfg.rope_theta)
            cos, sin = cos[ctx_len][:, None], sin[ctx_len][:, None]
            # keys [query ; context]: the masked ones (context padding) form a suffix
            h, _ = self._layers(h, is_gen, cos, sin, context_kv, ctx_len + h.shape[1], False, lora_scale)
            return self.llm2vae(self.norm_moe_gen(h[:, 1:-1]))


def velocity(model: BagelModel, context_ids: jax.Array, context_mask: jax.Array, latents: jax.Array, t: jax.Array,
             grid_hw: tuple[int, int]) -> jax.Array:
    """The generation tokens' velocity: `denoise` over the `prefill` of the context."""
    return model.denoise(model.prefill(context_ids), context_mask, latents, t, grid_hw)
