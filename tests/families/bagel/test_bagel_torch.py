"""The torch BAGEL generation path (jaxflow_bridge/families/bagel/model.py) against the independent reference
(tests/bagel_ref.py) and the Flax model (jaxflow/families/bagel), float32 on CPU, one seeded state dict for all."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxflow.families.bagel.config import TINY
from jaxflow.families.bagel.loading import build
from jaxflow.families.bagel.model import velocity as flax_velocity
from jaxflow_bridge.families.bagel import keymap as bagel_keymap
from jaxflow_bridge.families.bagel.model import BagelTorch
from tests import bagel_ref
from tests.bagel_ref import OTHER

# Bound on max|v - v_ref| / max|v_ref| and on the context K/V: 256 float32 ulps (u = 2**-24) of the output scale.
# Both sides are plain float32 with different summation orders (batched, padded matmuls and SDPA against per-sample
# ones); a K-term dot product rounds within K u of the sum of |terms|, the longest reduction is K = 256 (the timestep
# MLP's input), and the RMS norms keep every layer's input at unit scale, so a 2-3 layer path stays within a small
# multiple of K u of the output scale whatever the CPU's vector width.
TOL = 256 * 2.0**-24
LENGTHS, GRID = (7, 3, 0), (4, 6)  # padded, shorter and empty contexts; a non-square 4 x 6 latent grid


def model_and_weights(cfg):
    sd = bagel_ref.weights(cfg)
    model = BagelTorch(**dataclasses.asdict(cfg))
    model.load_checkpoint(sd)
    return model, sd


def inputs(cfg, seed=0):
    rng = np.random.default_rng(seed)
    ids = torch.from_numpy(rng.integers(0, cfg.vocab_size - 2, (len(LENGTHS), max(LENGTHS) + 1)))
    mask = torch.arange(ids.shape[1])[None] < torch.tensor(LENGTHS)[:, None]
    x = torch.from_numpy(rng.standard_normal((len(LENGTHS), GRID[0] * GRID[1], cfg.latent_dim)).astype(np.float32))
    return ids, mask, x, torch.tensor([1.0, 0.37, 0.02])


def rel_err(out, ref):
    return float(np.max(np.abs(np.asarray(out) - np.asarray(ref))) / np.max(np.abs(np.asarray(ref))))


def reference_error(cfg, sd, model, ids, mask, x, t):
    """Largest relative error of model's K/V and velocities against bagel_ref, sample by sample."""
    ctx = model.prefill(ids, mask)
    v = model.velocity(x, t, ctx, GRID)
    errs = []
    for b, n in enumerate(LENGTHS):
        tokens = ids[b, :n].tolist()
        errs.append(rel_err(v[b], bagel_ref.velocity(sd, cfg, tokens, x[b].numpy(), float(t[b]), GRID)))
        for i, (k, v_) in enumerate(bagel_ref.prefill(sd, cfg, tokens) if n else []):
            errs += [rel_err(ctx.keys[i][b, :n], k), rel_err(ctx.values[i][b, :n], v_)]
    return max(errs)


@pytest.mark.parametrize("cfg", [TINY, OTHER], ids=["tiny", "other"])
def test_matches_reference(cfg):
    model, sd = model_and_weights(cfg)
    assert reference_error(cfg, sd, model, *inputs(cfg)) <= TOL


def test_parity_detects_swapped_experts():
    """The same comparison fails when the model is loaded with the experts' weights swapped."""
    _, sd = model_and_weights(TINY)
    flax = bagel_keymap.to_flax({k: v.numpy() for k, v in sd.items()}, TINY.num_hidden_layers)
    flax = {(p[0], {"und": "gen", "gen": "und"}[p[1]], *p[2:]) if p[0] == "layers" else p: v for p, v in flax.items()}
    swapped = {k: torch.from_numpy(v) for k, v in bagel_keymap.to_checkpoint(flax, TINY.num_hidden_layers).items()}
    model = BagelTorch(**dataclasses.asdict(TINY))
    model.load_checkpoint(swapped)
    assert reference_error(TINY, sd, model, *inputs(TINY)) > 1e3 * TOL


def test_matches_flax_model():
    """The same state dict in the Flax model (through the key map) gives the same velocities, padded contexts and
    an empty one in one batch."""
    model, sd = model_and_weights(TINY)
    ids, mask, x, t = inputs(TINY)
    flax = build(TINY, bagel_keymap.to_flax({k: v.numpy() for k, v in sd.items()}, TINY.num_hidden_layers))
    want = np.asarray(flax_velocity(flax, jnp.asarray(ids.numpy().astype(np.int32)), jnp.asarray(mask.numpy()),
                                    jnp.asarray(x.numpy()), jnp.asarray(t.numpy()), GRID))
    got = model.velocity(x, t, model.prefill(ids, mask), GRID).numpy()
    assert max(rel_err(got[b], want[b]) for b in range(len(LENGTHS))) <= TOL


def test_a_sample_does_not_depend_on_its_batch():
    model, _ = model_and_weights(TINY)
    ids, mask, x, t = inputs(TINY)
    both = model.velocity(x, t, model.prefill(ids, mask), GRID)
    n = LENGTHS[1]
    alone = model.velocity(x[1:2], t[1:2], model.prefill(ids[1:2, :n], mask[1:2, :n]), GRID)
    assert rel_err(both[1], alone[0]) <= TOL


def test_refusals_name_the_problem():
    model, sd = model_and_weights(TINY)
    key = "language_model.model.layers.1.mlp_moe_gen.up_proj.weight"
    with pytest.raises(ValueError, match=rf"missing \['{key}'\]"):
        model.load_checkpoint({k: v for k, v in sd.items() if k != key})
    with pytest.raises(ValueError, match=r"unexpected \['language_model.model.layers.0.self_attn.o_proj.bias'\]"):
        model.load_checkpoint({**sd, "language_model.model.layers.0.self_attn.o_proj.bias": torch.zeros(64)})
    with pytest.raises(ValueError, match="vae2llm.bias: \\(3,\\)"):
        model.load_checkpoint({**sd, "vae2llm.bias": torch.zeros(3)})
    ids, mask, x, t = inputs(TINY)
    with pytest.raises(ValueError, match="left-aligned"):
        model.prefill(ids, mask.flip(1))
    with pytest.raises(ValueError, match=r"must be \(B, h\*w = 20"):
        model.velocity(x, t, model.prefill(ids, mask), (4, 5))
