"""Flax BAGEL generation path vs the pure-torch reference (tests/bagel_ref.py), float32 on CPU; MoT routing; the
checkpoint <-> Flax key map (docs/bagel.md §7 stage (a))."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxflow.families.bagel.config import TINY, BagelConfig
from jaxflow.families.bagel.embeddings import latent_pos_table
from jaxflow.families.bagel.loading import arrays, build
from jaxflow.families.bagel.model import velocity
from jaxflow.families.bagel.mot import Make, MoTLayer
from jaxflow.nn.config import ModelOptions
from jaxflow_bridge.families.bagel import keymap as bagel_keymap
from tests import bagel_ref
from tests.bagel_helpers import LENGTHS, PARITY_GRID, TOL, checkpoint, flax_velocity, inputs, max_rel_err
from tests.bagel_ref import OTHER


@pytest.mark.parametrize("cfg", [TINY, OTHER], ids=["tiny", "other"])
def test_velocity_matches_torch_reference(cfg):
    sd = checkpoint(cfg)
    model = build(cfg, bagel_keymap.to_flax(sd, cfg.num_hidden_layers))
    ids, mask, x, t = inputs(cfg)
    out = flax_velocity(model, ids, mask, x, t)
    assert out.shape == x.shape
    assert max_rel_err(cfg, sd, out, ids, x, t) <= TOL


def test_parity_detects_swapped_experts():
    """The same comparison fails when the Flax model reads the experts the wrong way round."""
    sd = checkpoint(TINY)
    flax = bagel_keymap.to_flax(sd, TINY.num_hidden_layers)
    swapped = {(p[0], {"und": "gen", "gen": "und"}[p[1]], *p[2:]) if p[0] == "layers" else p: v
               for p, v in flax.items()}
    ids, mask, x, t = inputs(TINY)
    assert max_rel_err(TINY, sd, flax_velocity(build(TINY, swapped), ids, mask, x, t), ids, x, t) > 1e3 * TOL


def test_padding_does_not_change_a_sample():
    """A context padded to a wider batch gives the same velocity as alone at its own width."""
    model = build(TINY, bagel_keymap.to_flax(checkpoint(TINY), TINY.num_hidden_layers))
    ids, mask, x, t = inputs(TINY)
    n = LENGTHS[1]
    alone = np.asarray(velocity(model, jnp.asarray(ids[1:2, :n]), jnp.asarray(mask[1:2, :n]),
                                jnp.asarray(x[1:2]), jnp.asarray(t[1:2]), PARITY_GRID))
    assert np.max(np.abs(flax_velocity(model, ids, mask, x, t)[1] - alone[0])) <= TOL * np.max(np.abs(alone))


def _perturbed(model, path, layer=0):
    params = arrays(model)
    params[path] = params[path].copy()
    params[path][layer] += 0.5
    return build(TINY, params)


@pytest.mark.parametrize("expert", ["gen", "und"])
def test_each_expert_moves_only_its_tokens(expert):
    """Perturbing one expert's k projection in layer 0: the context K/V change iff it is the understanding expert;
    the velocity changes either way (markers and latents attend to each other)."""
    model = build(TINY, bagel_keymap.to_flax(checkpoint(TINY), TINY.num_hidden_layers))
    other = _perturbed(model, ("layers", expert, "k_proj", "kernel"))
    ids, mask, x, t = inputs(TINY)
    kv, kv2 = (m.prefill(jnp.asarray(ids)) for m in (model, other))
    same_context = all(np.array_equal(a, b) for a, b in zip(kv, kv2))
    assert same_context == (expert == "gen")
    assert not np.allclose(flax_velocity(model, ids, mask, x, t), flax_velocity(other, ids, mask, x, t))


@pytest.mark.slow
def test_layer_routes_each_token_to_its_expert():
    """In one layer, a token's own k/v come from its expert alone: changing the generation expert's k/v projections
    leaves the understanding tokens' k/v bit-identical and changes every generation token's."""
    layer = MoTLayer(TINY, Make(ModelOptions(), nnx.Rngs(0)))
    is_gen = np.array([False, True, True, False, True, False])
    h = jnp.asarray(np.random.default_rng(1).standard_normal((2, len(is_gen), TINY.hidden_size)), jnp.float32)
    ones = jnp.ones((1, 1, TINY.head_dim // 2))
    run = lambda: layer(h, is_gen, ones, 0 * ones, None, None, False, "xla")[1]  # noqa: E731
    before = run()
    for proj in (layer.gen.k_proj, layer.gen.v_proj):
        proj.kernel.set_value(proj.kernel[...] + 0.5)
    for a, b in zip(before, run()):
        assert np.array_equal(a[:, ~is_gen], b[:, ~is_gen])
        assert np.all(np.any(np.asarray(a[:, is_gen] != b[:, is_gen]), axis=(-1, -2)))


def test_key_map_round_trip():
    """Every checkpoint tensor the path reads maps to one Flax leaf and back, unchanged; the ignored ones drop."""
    entries = bagel_keymap.key_map()
    keys = [k for e in entries for k in e.diffusers_keys(TINY.num_hidden_layers)]
    assert len(keys) == len(set(keys)) and len({e.flax_path for e in entries}) == len(entries)
    sd = checkpoint(TINY)
    back = bagel_keymap.to_checkpoint(arrays(build(TINY, bagel_keymap.to_flax(sd, TINY.num_hidden_layers))),
                                      TINY.num_hidden_layers)
    ignored = {k for k in sd if k.startswith(bagel_keymap.IGNORED_PREFIXES)}
    assert ignored == {"language_model.model.norm.weight", "language_model.lm_head.weight", "connector.fc1.weight",
                       "connector.fc1.bias"}
    assert set(back) == set(sd) - ignored
    assert all(np.array_equal(back[k], sd[k]) for k in back)


def test_key_map_names_a_missing_or_unexpected_tensor():
    sd = checkpoint(TINY)
    missing = {k: v for k, v in sd.items() if k != "language_model.model.layers.1.mlp_moe_gen.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing \['language_model.model.layers.1.mlp_moe_gen.up_proj.weight'\]"):
        bagel_keymap.to_flax(missing, TINY.num_hidden_layers)
    extra = {**sd, "language_model.model.layers.0.self_attn.o_proj.bias": np.zeros(TINY.hidden_size, np.float32)}
    with pytest.raises(ValueError, match=r"unexpected \['language_model.model.layers.0.self_attn.o_proj.bias'\]"):
        bagel_keymap.to_flax(extra, TINY.num_hidden_layers)
    flax = bagel_keymap.to_flax(sd, TINY.num_hidden_layers)
    del flax[("layers", "gen", "q_norm", "scale")]
    with pytest.raises(ValueError, match=r"missing \[\('layers', 'gen', 'q_norm', 'scale'\)\]"):
        bagel_keymap.to_checkpoint(flax, TINY.num_hidden_layers)
    with pytest.raises(ValueError, match="layers/gen/q_norm/scale: got None"):
        build(TINY, flax)


def test_latent_pos_table_matches_reference():
    """Both sides evaluate the table in float64 and round once to float32: at most one float32 ulp (2**-24 for
    values in [-1, 1]) apart."""
    ours, ref = latent_pos_table(8, 64), bagel_ref.sincos_2d(8, 64).numpy()
    assert ours.shape == ref.shape and np.max(np.abs(ours - ref)) <= 2.0**-24


def test_config_refuses_impossible_geometry():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        dataclasses.replace(TINY, num_key_value_heads=3)
    with pytest.raises(ValueError, match="vision_end_id"):
        dataclasses.replace(TINY, vision_end_id=384)
    llm = {**{f.name: getattr(TINY, f.name) for f in dataclasses.fields(BagelConfig)}, "hidden_act": "silu"}
    top = {"latent_patch_size": 2, "vae_config": {"z_channels": 16}, "max_latent_size": 32}
    assert BagelConfig.from_dicts(llm, top, vision_start_id=382, vision_end_id=383) == TINY
    with pytest.raises(ValueError, match="hidden_act"):
        BagelConfig.from_dicts({**llm, "hidden_act": "gelu"}, top)
