"""LoRA on BAGEL's generation expert (docs/bagel.md §5): zero-B identity, the context K/V untouched, parity with
the torch reference on merged weights, gradients, the PEFT key map and PEFT folders."""
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxflow.families.bagel.config import TINY
from jaxflow.families.bagel.loading import build
from jaxflow.families.bagel.lora import BagelLoRASpec, peft_state_dict, read_peft, save_peft, set_peft
from jaxflow.families.bagel.model import BagelModel, velocity
from jaxflow.nn.lora import LoRAParam
from jaxflow.families.qwen_image.lora import QwenImageLoRASpec as LoRASpec
from jaxflow_bridge.families.bagel import keymap as bagel_keymap
from tests.bagel_ref import OTHER
from tests.bagel_helpers import (PARITY_GRID, TOL, checkpoint, flax_velocity, inputs, max_rel_err, merged,
                                 random_adapter)

SPEC = BagelLoRASpec(rank=4, alpha=8.0)
SECTION_5 = ("q_proj_moe_gen", "k_proj_moe_gen", "v_proj_moe_gen", "o_proj_moe_gen", "mlp_moe_gen.gate_proj",
             "mlp_moe_gen.up_proj", "mlp_moe_gen.down_proj")


def lora_model(cfg, spec=SPEC, seed=1):
    sd = checkpoint(cfg)
    model = build(cfg, bagel_keymap.to_flax(sd, cfg.num_hidden_layers), lora=spec)
    adapter = random_adapter(model, spec, seed)
    set_peft(model, spec, adapter)
    return sd, model, adapter


@pytest.mark.slow
def test_zero_b_is_the_base_model():
    """PEFT's init (B = 0, A random): the velocity equals the base model's bit for bit."""
    sd = checkpoint(TINY)
    params = bagel_keymap.to_flax(sd, TINY.num_hidden_layers)
    base, lora = build(TINY, params), build(TINY, params, lora=SPEC)
    state = nnx.state(lora, LoRAParam)
    leaves = dict(nnx.to_flat_state(state))
    assert all(not np.any(v[...]) for p, v in leaves.items() if p[-1] == "lora_b")
    assert all(np.all(np.any(v[...] != 0, axis=(1, 2))) for p, v in leaves.items() if p[-1] == "lora_a")
    ids, mask, x, t = inputs(TINY)
    assert np.array_equal(flax_velocity(lora, ids, mask, x, t), flax_velocity(base, ids, mask, x, t))


@pytest.mark.slow
def test_adapter_moves_generation_tokens_only():
    """A nonzero adapter changes every sample's velocity and leaves the context K/V (prefill: understanding expert
    only) bit-identical."""
    sd, model, _ = lora_model(TINY)
    base = build(TINY, bagel_keymap.to_flax(sd, TINY.num_hidden_layers))
    ids, mask, x, t = inputs(TINY)
    for a, b in zip(model.prefill(jnp.asarray(ids)), base.prefill(jnp.asarray(ids))):
        assert np.array_equal(a, b)
    v, v0 = flax_velocity(model, ids, mask, x, t), flax_velocity(base, ids, mask, x, t)
    assert np.all(np.max(np.abs(v - v0), axis=(1, 2)) > 1e3 * TOL * np.max(np.abs(v0)))
    # lora_scale 0 (FlowGRPO's KL reference) is the base model bit for bit: the adapters add exact zeros
    kv = model.prefill(jnp.asarray(ids))
    off = model.denoise(kv, jnp.asarray(mask), jnp.asarray(x), jnp.asarray(t), PARITY_GRID, lora_scale=0.0)
    assert np.array_equal(np.asarray(off), v0)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [TINY, OTHER], ids=["tiny", "other"])
def test_lora_matches_torch_reference_with_merged_weights(cfg):
    """Flax's x W + (x A) (s B) equals the torch reference on W + s B A within the base parity test's bound; the
    same reference without the merge is far off (the adapter matters at that scale)."""
    sd, model, adapter = lora_model(cfg)
    ids, mask, x, t = inputs(cfg)
    out = flax_velocity(model, ids, mask, x, t)
    assert max_rel_err(cfg, merged(sd, adapter, SPEC), out, ids, x, t) <= TOL
    assert max_rel_err(cfg, sd, out, ids, x, t) > 1e3 * TOL


@pytest.mark.slow
def test_gradients_reach_every_generation_adapter_only():
    """d loss / d LoRA is nonzero for every adapter leaf in every layer; the understanding expert has no LoRA
    params at all (nor any other module outside layers/gen)."""
    _, model, _ = lora_model(TINY)
    ids, mask, x, t = (jnp.asarray(a) for a in inputs(TINY))

    def loss(m):
        return jnp.sum(velocity(m, ids, mask, x, t, PARITY_GRID) ** 2)

    grads = nnx.grad(loss, argnums=nnx.DiffState(0, LoRAParam))(model)
    flat = dict(nnx.to_flat_state(grads))
    assert set(flat) == {("layers", "gen", bagel_keymap.LORA_TARGETS[tg], leaf) for tg in SECTION_5
                         for leaf in ("lora_a", "lora_b")}
    for path, g in flat.items():
        g = np.asarray(g[...])
        assert g.shape[0] == TINY.num_hidden_layers and np.all(np.any(g != 0, axis=(1, 2))), path
    assert not nnx.to_flat_state(nnx.state(model.layers.und, LoRAParam))
    assert all(p[:2] == ("layers", "gen") for p, _ in nnx.to_flat_state(nnx.state(model, LoRAParam)))


def test_spec_targets_select_the_adapted_projections():
    model = BagelModel(TINY, lora=BagelLoRASpec(rank=2, targets=("o_proj_moe_gen", "mlp_moe_gen.up_proj")),
                       rngs=nnx.Rngs(0))
    paths = {p for p, _ in nnx.to_flat_state(nnx.state(model, LoRAParam))}
    assert paths == {("layers", "gen", leaf, ab) for leaf in ("o_proj", "up_proj") for ab in ("lora_a", "lora_b")}


def test_lora_key_map_names_every_adapter_once():
    """§5's seven targets are the defaults; every (layer, adapter, A/B) has one PEFT key in BAGEL's names, they
    cover the model's LoRA params exactly, and a PEFT state dict round-trips through the model."""
    assert bagel_keymap.DEFAULT_LORA_TARGETS == SECTION_5 and SPEC.targets == SECTION_5
    entries = bagel_keymap.lora_key_map(SPEC.targets)
    keys = [k for e in entries for k in e.diffusers_keys(TINY.num_hidden_layers)]
    assert len(keys) == len(set(keys)) == 7 * 2 * TINY.num_hidden_layers
    assert "language_model.model.layers.1.mlp_moe_gen.gate_proj.lora_B.weight" in keys
    assert "language_model.model.layers.0.self_attn.q_proj_moe_gen.lora_A.weight" in keys
    # each adapted module is a generation-expert linear of the base key map, and no understanding one
    base = {k.removesuffix(".weight") for e in bagel_keymap.key_map() for k in e.diffusers_keys(TINY.num_hidden_layers)}
    modules = {k.rsplit(".lora_", 1)[0] for k in keys}
    assert modules <= base and all("moe_gen" in m for m in modules)
    _, model, adapter = lora_model(TINY)
    assert {e.flax_path for e in entries} == {p for p, _ in nnx.to_flat_state(nnx.state(model, LoRAParam))}
    back = peft_state_dict(model, SPEC)
    assert set(back) == {bagel_keymap.PEFT_PREFIX + k for k in keys} == set(adapter)
    assert all(np.array_equal(back[k], adapter[k]) for k in back)


@pytest.mark.parametrize("target", ["q_proj", "mlp.gate_proj", "gate_proj", "time_embedder.mlp.0", "to_q"])
def test_unknown_target_is_refused_by_name(target):
    with pytest.raises(ValueError, match=f"unknown BAGEL LoRA target '{target}'"):
        BagelLoRASpec(targets=(target,))
    with pytest.raises(ValueError, match=f"'{target}'"):
        bagel_keymap.lora_key_map((target,))


def test_model_refuses_a_qwen_spec_and_a_bad_peft_dict():
    with pytest.raises(ValueError, match="unknown BAGEL LoRA target 'to_q'"):
        BagelModel(TINY, lora=LoRASpec(), rngs=nnx.Rngs(0))
    _, model, adapter = lora_model(TINY)
    key = "base_model.model.language_model.model.layers.1.self_attn.v_proj_moe_gen.lora_B.weight"
    with pytest.raises(ValueError, match="missing language_model.model.layers.1.self_attn.v_proj_moe_gen.lora_B"):
        set_peft(model, SPEC, {k: v for k, v in adapter.items() if k != key})


def test_peft_folder_round_trip(tmp_path):
    """save_peft writes the adapters in BAGEL's names with their config; read_peft gives back the spec and tensors,
    and a fresh model set from them has the saved adapters bit for bit; saving again replaces the folder."""
    sd, model, adapter = lora_model(TINY)
    folder = save_peft(model, SPEC, tmp_path / "adapter")
    spec, tensors = read_peft(folder)
    assert spec == SPEC and set(tensors) == set(adapter)
    assert all(k.startswith(bagel_keymap.PEFT_PREFIX) for k in tensors)
    fresh = build(TINY, bagel_keymap.to_flax(sd, TINY.num_hidden_layers), lora=spec)
    set_peft(fresh, spec, tensors)
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model, LoRAParam)),
                                 nnx.to_flat_state(nnx.state(fresh, LoRAParam))):
        assert np.array_equal(a[...], b[...]), path
    other = random_adapter(model, SPEC, seed=7)
    set_peft(model, SPEC, other)
    save_peft(model, SPEC, folder)
    assert all(np.array_equal(v, other[k]) for k, v in read_peft(folder)[1].items())


def test_peft_folder_refuses_a_foreign_target_and_a_missing_config(tmp_path):
    _, model, _ = lora_model(TINY)
    folder = save_peft(model, SPEC, tmp_path / "adapter")
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "to_q"]}))
    with pytest.raises(ValueError, match="unknown BAGEL LoRA target 'q_proj'"):
        read_peft(folder)
    (folder / "adapter_config.json").unlink()
    with pytest.raises(ValueError, match="no adapter_config.json"):
        read_peft(folder)
