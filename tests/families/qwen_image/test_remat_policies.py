"""Remat policies by name: save_matmuls_stats keeps what cuDNN attention's backward needs, and only on cuDNN."""
import contextlib
import io
import re

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name, print_saved_residuals
from jax.extend.core import Primitive

from jaxflow.families.qwen_image.transformer import CUDNN_ATTENTION_FWD, remat_policy


def test_the_policy_names_jax_s_cudnn_attention_forward_primitive():
    # the policy matches the primitive by name: a rename in jax would silently bring back the recompute
    from jax._src.cudnn import fused_attention_stablehlo as fused
    assert fused._dot_product_attention_fwd_p_wrapper.name == CUDNN_ATTENTION_FWD


def test_save_matmuls_stats_saves_the_attention_forward_and_named_matmuls_not_attn_out():
    policy = remat_policy("save_matmuls_stats", "cudnn")
    assert policy(Primitive(CUDNN_ATTENTION_FWD))
    assert not policy(Primitive("dot_product_attention_bwd_wrapper"))

    def f(x, w):
        q = checkpoint_name(x @ w, "qkv")
        o = checkpoint_name(jnp.sin(q) @ w, "attn_out")
        h = checkpoint_name(jnp.cos(o) @ w, "mlp_hidden")
        return jnp.sum(jnp.tanh(h))

    x, w = jnp.ones((4, 8)), jnp.full((8, 8), 0.1)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print_saved_residuals(jax.checkpoint(f, policy=policy), x, w)
    names = set(re.findall(r"named '(\w+)'", text.getvalue()))
    assert names == {"qkv", "mlp_hidden"}


def test_save_matmuls_stats_refuses_the_xla_attention():
    with pytest.raises(ValueError, match="use model.remat=save_matmuls"):
        remat_policy("save_matmuls_stats", "xla")
    assert remat_policy("save_matmuls", "xla") is not None


def test_a_model_with_save_matmuls_stats_is_refused_when_built_off_cudnn():
    from flax import nnx

    from jaxflow.families.qwen_image.config import QwenImageConfig
    from jaxflow.nn.config import ModelOptions
    from jaxflow.families.qwen_image.transformer import QwenImageTransformer
    cfg = QwenImageConfig(num_layers=1, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=64,
                          in_channels=16, out_channels=4, axes_dims_rope=(8, 12, 12))
    with pytest.raises(ValueError, match="save_matmuls_stats"):
        QwenImageTransformer(cfg, ModelOptions(remat="save_matmuls_stats"), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("remat", [pytest.param("full", marks=pytest.mark.slow), "save_matmuls"])
def test_remat_leaves_the_gradient_unchanged(remat):
    from flax import nnx

    from jaxflow.families.qwen_image.config import QwenImageConfig
    from jaxflow.nn.config import ModelOptions
    from jaxflow.families.qwen_image.transformer import QwenImageTransformer
    cfg = QwenImageConfig(num_layers=1, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=64,
                          axes_dims_rope=(8, 12, 12))
    x = jax.random.normal(jax.random.key(1), (1, 4, 64))
    txt = jax.random.normal(jax.random.key(2), (1, 3, 64))

    def grad(opts):  # jitted, as the train step runs it (and quicker than op by op)
        model = QwenImageTransformer(cfg, opts, rngs=nnx.Rngs(0))
        return jax.jit(jax.grad(lambda x: jnp.sum(model(x, jnp.full((1,), 0.5), txt, None, (2, 2)) ** 2)))(x)

    plain, rematted = grad(ModelOptions()), grad(ModelOptions(remat=remat))
    assert float(jnp.max(jnp.abs(plain))) > 0
    # the same float32 ops at HIGHEST precision recomputed: equal up to fusion-order rounding
    assert jnp.allclose(plain, rematted, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(plain))))


def test_the_remat_policy_follows_the_model_options_at_trace_time():
    # bench_train_step.py's variants change `model.opts` on one built model; a policy fixed at build time made its
    # remat variants time the build's policy instead
    import dataclasses

    from flax import nnx

    from jaxflow.families.qwen_image.config import QwenImageConfig
    from jaxflow.nn.config import ModelOptions
    from jaxflow.families.qwen_image.transformer import QwenImageTransformer
    cfg = QwenImageConfig(num_layers=1, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=64,
                          axes_dims_rope=(8, 12, 12))
    model = QwenImageTransformer(cfg, ModelOptions(), rngs=nnx.Rngs(0))
    x, txt = jnp.ones((1, 4, 64)), jnp.ones((1, 3, 64))

    def checkpoints():
        jaxpr = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(model(x, jnp.full((1,), 0.5), txt, None, (2, 2)))))(x)
        return len(re.findall(r"\b(?:checkpoint|remat\d*)\[", str(jaxpr)))

    assert checkpoints() == 0
    model.opts = dataclasses.replace(model.opts, remat="full")
    assert checkpoints() > 0
