"""The attention implementation and the matmul precision are chosen explicitly from the compute dtype."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxflow.nn.attention import resolve_implementation
from jaxflow.families.qwen_image.config import QwenImageConfig
from jaxflow.nn.config import ModelOptions
from jaxflow.families.qwen_image.transformer import QwenImageTransformer

TINY = QwenImageConfig(num_layers=1, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=64,
                       axes_dims_rope=(8, 12, 12))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_auto_attention_is_xla_off_gpu(dtype):
    assert jax.default_backend() == "cpu"  # the test suite runs on CPU
    assert resolve_implementation("auto", dtype) == "xla"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cudnn_refused_where_it_cannot_run(dtype):
    # off a GPU always, and float32 on a GPU too (cuDNN's fused attention takes bf16/fp16 only)
    with pytest.raises(ValueError, match="attention='cudnn' needs a GPU"):
        resolve_implementation("cudnn", dtype)


def test_precision_resolves_by_compute_dtype():
    assert ModelOptions(dtype="float32").precision == "highest"
    assert ModelOptions(dtype="bfloat16", param_dtype="bfloat16").precision == "default"
    assert ModelOptions(dtype="float32", matmul_precision="high").precision == "high"
    with pytest.raises(ValueError, match="matmul_precision"):
        ModelOptions(matmul_precision="tf32")


def _dot_precisions(opts: ModelOptions) -> set:
    model = QwenImageTransformer(TINY, opts, rngs=nnx.Rngs(0))
    x, txt = jnp.zeros((1, 4, 64)), jnp.zeros((1, 3, 64))
    jaxpr = jax.make_jaxpr(lambda: model(x, jnp.full((1,), 0.5), txt, None, (2, 2)))()
    found = set()

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "dot_general":
                found.add(eqn.params["precision"])
            for v in eqn.params.values():  # the layer scan, remat and pjit bodies
                inner = getattr(v, "jaxpr", None)
                if inner is not None:
                    walk(getattr(inner, "jaxpr", inner))
    walk(jaxpr.jaxpr)
    return found


@pytest.mark.slow
def test_float32_model_traces_every_matmul_at_highest():
    found = _dot_precisions(ModelOptions(dtype="float32"))
    highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    assert found == {highest}, found  # attention's einsums and every projection, inside the layer scan too


def test_bfloat16_model_keeps_default_precision():
    found = _dot_precisions(ModelOptions(dtype="bfloat16", param_dtype="bfloat16"))
    highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    assert found and highest not in found, found
