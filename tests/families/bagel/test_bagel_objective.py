"""BAGEL's FlowGRPO log-prob in JAX (jaxflow/families/bagel/objective.py) replaying the torch rollout (bagel_sampling over
bagel_torch, the same seeded weights), float32 on CPU: text CFG with an interval and a window, mutations, LoRA."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxflow.families.bagel import objective as bf
from jaxflow.families.bagel.config import TINY
from jaxflow.families.bagel.loading import build
from jaxflow.families.bagel.lora import set_peft
from jaxflow.nn.lora import LoRAParam
from jaxflow_bridge.families.bagel import keymap as bagel_keymap
from jaxflow_bridge.families.bagel.sampling import guided_velocity
from tests import bagel_ref
from tests.bagel_helpers import GUIDANCE, ROLLOUT_GRID, SP, SPEC, U, arrays, bound, random_adapter, sampled


def rollout(adapter: bool):
    """(Flax model, batch dict, torch log-probs) of `sampled`."""
    model, out = sampled(adapter)
    return model, arrays(out), out.log_probs


@pytest.fixture(scope="module")
def base():
    return rollout(adapter=False)


def log_probs(model, batch, guidance=GUIDANCE):
    return np.asarray(bf.window_log_probs(model, batch, grid_hw=ROLLOUT_GRID, sde_type="sde", guidance=guidance))


@pytest.mark.slow
@pytest.mark.parametrize("adapter", [False, True], ids=["base", "lora"])
def test_replays_the_rollout_log_probs(base, adapter):
    """The rollout's windows cover guided (sigma 1, 0.9) and unguided (0.75, 0.5) steps and sigma = 1 (sigma_max in
    the std); every recomputed log-prob is within its bound of the rollout's."""
    model, batch, want = rollout(adapter=True) if adapter else base
    idx = np.asarray(batch["step_index"])
    assert 0 in idx and {0, 1} & set(idx.ravel()) and {2, 3} & set(idx.ravel())
    got, tol = log_probs(model, batch), bound(model, batch)
    assert got.shape == want.shape == (4, 2) and got.dtype == np.float32
    assert np.all(np.abs(got - want) <= tol), (got - want, tol)


@pytest.mark.slow
@pytest.mark.parametrize("mutation", ["cfg_off", "cfg_interval", "step_index"])
def test_mutations_move_the_log_probs_beyond_the_bound(base, mutation):
    """CFG dropped, a wrong interval or a shifted step index moves some log-prob by more than 10 times its bound
    (the log-prob of a stored transition moves mostly at second order in the velocity; the CFG formula itself is
    pinned sharply by `test_cfg_matches_the_rollouts_formula`)."""
    model, batch, want = base
    guidance = {"cfg_off": dataclasses.replace(GUIDANCE, text_scale=1.0),
                "cfg_interval": dataclasses.replace(GUIDANCE, interval=(0.0, 1.0))}.get(mutation, GUIDANCE)
    if mutation == "step_index":
        assert int(batch["step_index"].max()) + 1 < SP.num_inference_steps
        batch = {**batch, "step_index": batch["step_index"] + 1}
    assert np.max(np.abs(log_probs(model, batch, guidance) - want) / bound(model, base[1])) > 10


def test_cfg_matches_the_rollouts_formula():
    """combine_cfg against bagel_sampling.guided_velocity on the same branch velocities, sample by sample: the same
    elementwise float32 ops, and norms of K = 15 squares in any order (relative error <= K u each), so within
    (2 K + 8) u of max|v|; outside the interval the conditional velocity exactly. A batch mate's norms play no
    part; a different scale, no renorm or a renorm over the batch are far off."""
    rng = np.random.default_rng(0)
    v_c, v_u = rng.standard_normal((2, 3, 5, 3)).astype(np.float32)
    v_c[0] *= 10.0  # sample 0 dominates any norm taken over the batch
    sigma = np.array([1.0, 0.9, 0.75], np.float32)  # interval (0.8, 1]: samples 0 and 1 guided
    tol = (2 * v_c[0].size + 8) * U
    for renorm_min in (0.0, 0.9):
        g = dataclasses.replace(GUIDANCE, renorm_min=renorm_min)
        got = np.asarray(bf.combine_cfg(jnp.asarray(v_c), jnp.asarray(v_u), jnp.asarray(sigma), g))
        want = guided_velocity(torch.from_numpy(v_c), torch.from_numpy(v_u), g.text_scale, renorm_min).numpy()
        for b in range(2):
            assert np.max(np.abs(got[b] - want[b])) <= tol * np.abs(want[b]).max()
        assert np.array_equal(got[2], v_c[2])
    got = np.asarray(bf.combine_cfg(jnp.asarray(v_c), jnp.asarray(v_u), jnp.asarray(sigma), GUIDANCE))
    wrong = [guided_velocity(torch.from_numpy(v_c), torch.from_numpy(v_u), 3.0, 0.0).numpy(),
             v_u + 4.0 * (v_c - v_u)]
    v = v_u + 4.0 * (v_c - v_u)
    wrong.append(v * min(np.linalg.norm(v_c) / np.linalg.norm(v), 1.0))
    for w in wrong:
        assert max(np.max(np.abs(got[b] - w[b])) / np.abs(w[b]).max() for b in range(2)) > 1e3 * tol


@pytest.mark.slow
def test_zero_b_lora_is_the_base_model(base):
    """PEFT's init (B = 0): the log-probs equal the base model's bit for bit."""
    model, batch, _ = base
    sd = {k: v.numpy() for k, v in bagel_ref.weights(TINY).items()}
    lora = build(TINY, bagel_keymap.to_flax(sd, TINY.num_hidden_layers), lora=SPEC)
    assert np.array_equal(log_probs(lora, batch), log_probs(model, batch))


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["zero_b", "random"])
def test_gradients_reach_the_adapters(base, adapter):
    """d sum(logp) / d LoRA through nnx split / merge: finite everywhere; nonzero in every layer for every B, and
    for every A once B != 0 (at B = 0, d / dA = 0 exactly)."""
    _, batch, _ = base
    sd = {k: v.numpy() for k, v in bagel_ref.weights(TINY).items()}
    model = build(TINY, bagel_keymap.to_flax(sd, TINY.num_hidden_layers), lora=SPEC)
    if adapter == "random":
        set_peft(model, SPEC, random_adapter(model, SPEC))
    graphdef, lora, rest = nnx.split(model, LoRAParam, ...)

    def loss(lora):
        m = nnx.merge(graphdef, lora, rest)
        return jnp.sum(bf.window_log_probs(m, batch, grid_hw=ROLLOUT_GRID, sde_type="sde", guidance=GUIDANCE))

    grads = dict(nnx.to_flat_state(jax.grad(loss)(lora)))
    assert len(grads) == 2 * len(SPEC.targets)
    for path, g in grads.items():
        g = np.asarray(g[...])
        assert np.all(np.isfinite(g)), path
        if path[-1] == "lora_a" and adapter == "zero_b":
            assert not np.any(g), path
        else:
            assert np.all(np.any(g != 0, axis=(1, 2))), path


def test_guidance_needs_the_unconditional_context_and_valid_knobs(base):
    model, batch, _ = base
    with pytest.raises(ValueError, match="needs negative_prompt_ids"):
        bf.contexts(model, {k: v for k, v in batch.items() if not k.startswith("negative")}, GUIDANCE)
    with pytest.raises(ValueError, match="text_scale >= 1"):
        bf.BagelGuidance(text_scale=0.5)
    with pytest.raises(ValueError, match="lo <= hi"):
        bf.BagelGuidance(interval=(0.9, 0.2))
