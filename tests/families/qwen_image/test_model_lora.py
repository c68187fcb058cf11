"""Flax LoRA vs diffusers + PEFT, PEFT-format export/import, merge, adapters-off."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from diffusers import QwenImagePipeline
from flax import nnx

from jaxflow.families.qwen_image.config import QwenImageConfig
from jaxflow.nn.layers import Linear
from jaxflow.families.qwen_image.loading import build_from_source, load_transformer, to_diffusers_state_dict
from jaxflow.nn.weights import TensorSource
from jaxflow.nn.lora import LoRAParam, lora_to_peft, peft_to_lora, save_peft
from jaxflow.families.qwen_image.lora import QwenImageLoRASpec as LoRASpec, read_peft
from jaxflow_bridge.families.qwen_image.tiny import tiny_pipeline_path
from tests.qwen_ref import TINY, inputs, state_dict_numpy, torch_forward, torch_model, torch_with_adapter

SPEC = LoRASpec(rank=4, alpha=8.0)


def _rel(a, b):
    return float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))


def _run(model, x, s, txt, mask, lora_scale=1.0):
    return model(jnp.asarray(x), jnp.asarray(s), jnp.asarray(txt), jnp.asarray(mask), (5, 9), lora_scale)


def test_lora_forward_matches_diffusers_peft():
    tm, base, peft_sd = torch_with_adapter(TINY, SPEC)
    assert any(k.endswith("to_out.0.lora_A.weight") for k in peft_sd)
    model = build_from_source(QwenImageConfig(**TINY), TensorSource(base), lora=SPEC)
    peft_to_lora(model, SPEC, peft_sd)
    x, s, txt, mask = inputs(TINY)
    ref = torch_forward(tm, x, s, txt, mask, (5, 9))
    assert _rel(_run(model, x, s, txt, mask), ref) <= 1e-5
    tm.disable_adapters()
    base_ref = torch_forward(tm, x, s, txt, mask, (5, 9))
    assert _rel(base_ref, ref) > 1e-2  # the adapter matters
    assert _rel(_run(model, x, s, txt, mask, lora_scale=0.0), base_ref) <= 1e-5  # adapters off = base


def test_fresh_lora_is_peft_gaussian_init_and_a_no_op():
    model = build_from_source(QwenImageConfig(**TINY), TensorSource(state_dict_numpy(torch_model(TINY))),
                              lora=LoRASpec(rank=16, alpha=32))
    sd = lora_to_peft(model, LoRASpec(rank=16, alpha=32))
    a = np.concatenate([v.ravel() for k, v in sd.items() if "lora_A" in k])
    assert all(not v.any() for k, v in sd.items() if "lora_B" in k)
    assert abs(a.std() - 1 / 16) < 0.1 / 16 and abs(a.mean()) < 0.01
    x, s, txt, mask = inputs(TINY)
    np.testing.assert_array_equal(np.asarray(_run(model, x, s, txt, mask)),
                                  np.asarray(_run(model, x, s, txt, mask, 0.0)))


def test_peft_round_trip_bit_exact_and_bad_adapters_refused(tmp_path):
    _, base, peft_sd = torch_with_adapter(TINY, SPEC)
    model = build_from_source(QwenImageConfig(**TINY), TensorSource(base), lora=SPEC)
    peft_to_lora(model, SPEC, peft_sd)
    save_peft(model, SPEC, tmp_path)
    spec, back = read_peft(tmp_path)
    assert spec == SPEC and back.keys() == peft_sd.keys()
    for k in peft_sd:
        np.testing.assert_array_equal(back[k], peft_sd[k])
    before = nnx.state(model, LoRAParam)
    bad = dict(peft_sd)
    bad.pop("transformer_blocks.1.img_mlp.net.2.lora_B.weight")
    bad["transformer_blocks.0.attn.to_q.lora_A.weight"] = np.zeros((5, 64), np.float32)
    bad["transformer_blocks.0.attn.nope.lora_A.weight"] = np.zeros((4, 64), np.float32)
    with pytest.raises(ValueError, match=r"3 problems.*shape.*missing.*unexpected"):
        peft_to_lora(model, SPEC, bad)
    after = nnx.state(model, LoRAParam)  # nothing half-applied
    for (p, a), (_, b) in zip(nnx.to_flat_state(before), nnx.to_flat_state(after)):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(p))


def test_merged_export_equals_adapter_forward():
    tm, base, peft_sd = torch_with_adapter(TINY, SPEC)
    model = build_from_source(QwenImageConfig(**TINY), TensorSource(base), lora=SPEC)
    peft_to_lora(model, SPEC, peft_sd)
    merged = build_from_source(QwenImageConfig(**TINY), TensorSource(to_diffusers_state_dict(model, merge_lora=True)))
    x, s, txt, mask = inputs(TINY)
    assert _rel(_run(merged, x, s, txt, mask), np.asarray(_run(model, x, s, txt, mask))) <= 1e-5


def test_exported_adapter_loads_in_diffusers_pipeline(tmp_path):
    folder = tiny_pipeline_path()
    pipe = QwenImagePipeline.from_pretrained(folder)
    model = load_transformer(folder / "transformer", lora=SPEC, seed=3)
    state = nnx.state(model, LoRAParam)
    for _, var in nnx.to_flat_state(state):  # non-zero B so the adapter changes the output
        var[...] = var[...] + 0.05
    nnx.update(model, state)
    save_peft(model, SPEC, tmp_path)
    pipe.load_lora_weights(tmp_path, weight_name="adapter_model.safetensors")
    cfg = dict(pipe.transformer.config)
    x, s, txt, mask = inputs({**TINY, **{k: cfg[k] for k in ("in_channels", "joint_attention_dim")}})
    ref = torch_forward(pipe.transformer, x, s, txt, mask, (5, 9))
    assert _rel(_run(model, x, s, txt, mask), ref) <= 1e-5


def test_spec_refuses_unknown_targets_and_bad_rank():
    with pytest.raises(ValueError, match="unknown LoRA target"):
        LoRASpec(rank=4, alpha=8.0, targets=("to_x",))
    with pytest.raises(ValueError, match="rank"):
        LoRASpec(rank=0, alpha=8.0)
    assert LoRASpec(rank=4, alpha=8.0, targets=("to_q",)).peft_config()["target_modules"] == ["to_q"]


def _lora_linear(dtype, alpha, seed=0):
    layer = Linear(24, 40, axes=("embed", "mlp"), dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(seed),
                   lora=LoRASpec(rank=4, alpha=alpha))
    layer.lora_b[...] = 0.3 * jnp.asarray(np.random.default_rng(seed).normal(size=(4, 40)), jnp.float32)
    x = jnp.asarray(np.random.default_rng(seed + 1).normal(size=(6, 24)), dtype)
    return layer, x


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("lora_scale", [1.0, 0.5, 0.0])
def test_lora_scale_on_b_is_bit_identical_to_peft_for_power_of_two_scales(dtype, lora_scale):
    layer, x = _lora_linear(dtype, alpha=8.0)  # alpha / rank = 2
    base = x @ layer.kernel[...].astype(dtype) + layer.bias[...].astype(dtype)
    delta = (x @ layer.lora_a[...].astype(dtype)) @ layer.lora_b[...].astype(dtype)
    peft = base + delta * jnp.asarray(2.0 * lora_scale, dtype)  # PEFT: the scale on the product
    np.testing.assert_array_equal(np.asarray(layer(x, lora_scale), np.float32), np.asarray(peft, np.float32))


def test_lora_forward_and_backward_have_no_full_size_multiply():
    """The LoRA scale acts on B (rank x out), so neither pass multiplies a (tokens x out) array (a full-size
    memory pass per adapted matmul at Qwen-Image's size)."""
    layer, x = _lora_linear(jnp.bfloat16, alpha=12.0)
    graphdef, lora, rest = nnx.split(layer, LoRAParam, ...)

    def loss(lora, x):
        return jnp.sum(nnx.merge(graphdef, lora, rest)(x).astype(jnp.float32) ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss))(lora, x)
    full = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "mul" and e.outvars[0].aval.shape == (6, 40)
            and e.outvars[0].aval.dtype == jnp.bfloat16]
    assert not full, full
