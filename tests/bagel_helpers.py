"""Plain helpers and constants shared by the BAGEL test modules (fixtures stay in the test modules).

- the velocity parity inputs (test_bagel_model.py, test_bagel_lora.py): TOL, LENGTHS, WIDTH, PARITY_GRID, checkpoint,
  inputs, flax_velocity, max_rel_err
- a random PEFT adapter over the generation expert and the torch checkpoint with it merged in (random_adapter, merged)
- the torch rollout the log-prob and train-step tests replay (test_bagel_objective.py, test_bagel_train_step.py):
  U, V_TOL, PROMPTS, SEEDS, ROLLOUT_GRID, SP, GUIDANCE, SPEC, sampled, arrays, bound
"""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxflow.families.bagel import objective as bf
from jaxflow.families.bagel.config import TINY
from jaxflow.families.bagel.loading import build
from jaxflow.families.bagel.lora import BagelLoRASpec, peft_state_dict, set_peft
from jaxflow.families.bagel.model import velocity
from jaxflow_bridge.families.bagel import keymap as bagel_keymap
from jaxflow_bridge.families.bagel.sampling import BagelSamplingLoop, BagelSamplingParams
from jaxflow_bridge.families.bagel.model import BagelTorch
from tests import bagel_ref

# ---------------------------------------------------------------------------------------------- velocity parity

# Bound on max|v_flax - v_torch| / max|v_torch|: 256 float32 ulps (u = 2**-24) of the output scale. The longest
# reduction is K = 256 terms (the timestep MLP's input); any summation order rounds a K-term dot product within
# K u of the sum of |terms|, and the RMS norms keep every layer's input at unit scale, so two different float32
# evaluations of the whole path stay within a small multiple of K u of the output scale at this depth (2-3 layers;
# measured: <= 10 ulps on both shapes, on CPUs with and without AVX-512 alike as both sides are plain float32).
TOL = 256 * 2.0**-24
LENGTHS, WIDTH, PARITY_GRID = (7, 3, 0), 8, (4, 6)  # two prompts of different lengths, one empty context; 4 x 6 latents


def checkpoint(cfg, seed=0):
    return {k: v.numpy() for k, v in bagel_ref.weights(cfg, seed).items()}


def inputs(cfg, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, cfg.vocab_size - 2, (len(LENGTHS), WIDTH)).astype(np.int32)
    mask = np.arange(WIDTH)[None] < np.array(LENGTHS)[:, None]
    x = rng.standard_normal((len(LENGTHS), PARITY_GRID[0] * PARITY_GRID[1], cfg.latent_dim)).astype(np.float32)
    return ids, mask, x, np.array([1.0, 0.37, 0.02], np.float32)


def flax_velocity(model, ids, mask, x, t):
    return np.asarray(velocity(model, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(x), jnp.asarray(t),
                               PARITY_GRID))


def max_rel_err(cfg, sd, out, ids, x, t):
    errs = []
    for b, n in enumerate(LENGTHS):
        ref = bagel_ref.velocity({k: bagel_ref.torch.from_numpy(v) for k, v in sd.items()}, cfg,
                                 [int(i) for i in ids[b, :n]], x[b], float(t[b]), PARITY_GRID)
        errs.append(float(np.max(np.abs(out[b] - ref)) / np.max(np.abs(ref))))
    return max(errs)


# ---------------------------------------------------------------------------------------------- PEFT adapters


def random_adapter(model, spec, seed=1) -> dict[str, np.ndarray]:
    """A nonzero PEFT state dict (torch layout) of the model's adapters: A ~ N(0, 1/in), B ~ N(0, 0.3^2)."""
    rng = np.random.default_rng(seed)
    out = {}
    for key, value in peft_state_dict(model, spec).items():
        std = value.shape[1] ** -0.5 if ".lora_A." in key else 0.3
        out[key] = (std * rng.standard_normal(value.shape)).astype(np.float32)
    return out


def merged(sd, adapter, spec):
    """The torch checkpoint with each adapter folded in: W + alpha/r * B A, found by the PEFT key's module name."""
    out = dict(sd)
    scale = spec.alpha / spec.rank
    for key, a in adapter.items():
        if ".lora_A." not in key:
            continue
        module = key.removeprefix(bagel_keymap.PEFT_PREFIX).removesuffix(".lora_A.weight")
        b = adapter[key.replace(".lora_A.", ".lora_B.")]
        out[f"{module}.weight"] = out[f"{module}.weight"] + scale * (b.astype(np.float64) @ a).astype(np.float32)
    return out


# ---------------------------------------------------------------------------------------------- the torch rollout

U = 2.0**-24  # float32 unit roundoff
# Each CFG branch's velocity, Flax against torch on the same weights: within 256 u of the sample's max|v|
# (tests/families/bagel/test_bagel_torch.py and test_bagel_model.py derive it; adapters merged into the torch weights keep it,
# test_bagel_lora.py).
V_TOL = 256 * U
PROMPTS, SEEDS, ROLLOUT_GRID = [[5, 17, 240, 3, 99], [311, 8, 42]], [21, 22, 23, 24], (4, 6)
# sigmas [1, .9, .75, .5, 0]: CFG at steps 0 and 1 only; windows of 2 starting at steps 0..2
SP = BagelSamplingParams(height=64, width=96, num_inference_steps=4, sde_window_range=(0, 3), cfg_interval=(0.8, 1.0),
                         cfg_text_scale=4.0)
GUIDANCE = bf.BagelGuidance(SP.cfg_text_scale, SP.cfg_interval, SP.cfg_renorm_min)
SPEC = BagelLoRASpec(rank=4, alpha=8.0)


def sampled(adapter: bool):
    """(Flax model, TrajectoryBatch): the loop run on the torch model, the same weights (and, with `adapter`, a
    random LoRA: merged into the torch weights, as adapters in the Flax model)."""
    sd = {k: v.numpy() for k, v in bagel_ref.weights(TINY).items()}
    model = build(TINY, bagel_keymap.to_flax(sd, TINY.num_hidden_layers), lora=SPEC if adapter else None)
    if adapter:
        peft = random_adapter(model, SPEC)
        set_peft(model, SPEC, peft)
        sd = merged(sd, peft, SPEC)
    torch_model = BagelTorch(**dataclasses.asdict(TINY))
    torch_model.load_checkpoint({k: torch.from_numpy(v) for k, v in sd.items()})
    return model, BagelSamplingLoop(torch_model).generate(PROMPTS, 2, SP, seeds=SEEDS)


def arrays(out) -> dict:
    """What `bf.window_log_probs` reads from a rollout's TrajectoryBatch, with the sampling's noise_level."""
    fields = ("prompt_ids", "prompt_mask", "negative_prompt_ids", "negative_prompt_mask", "latents", "sigmas",
              "step_index")
    batch = {k: jnp.asarray(v) for k, v in out.to_dict().items() if k in fields}
    return {**batch, "noise_level": jnp.float32(SP.noise_level)}


def bound(model, batch) -> np.ndarray:
    """(B, W) bound on |logp_jax - logp_torch|, from the Flax branch velocities at each stored transition.

    Each branch differs by e <= V_TOL max|v_c|, |v_u|. CFG: v = v_u + s (v_c - v_u) moves by (2s + 1) e, and f v
    (f = |v_c| / |v| <= 1) by (2s + 1) e + f max|v| |df| / f with |df| / f <= |dv_c|_2 / |v_c|_2 + |dv|_2 / |v|_2 and
    |dv|_2 <= sqrt(K) max|dv|. The SDE mean x a + v b moves by |b| dv plus a few roundings of each term (8 u); the
    log-prob, a mean over K elements of -z^2 / 2 - log s - log(2 pi) / 2 (z = (x_next - mean) / s), moves by
    mean|z| max|dmean| / s to first order, plus the rounding of its terms and of a K-term sum in any order
    (2 (K + 8) u mean|term| for both sides): no assumption on the summation order or the CPU's vector width."""
    cond, uncond = bf.contexts(model, batch, GUIDANCE)
    per_step, shared = bf.window_steps(batch)
    per_step, shared = jax.tree.map(np.asarray, (per_step, shared))
    w, b = per_step["sigma"].shape
    s, lo, hi = GUIDANCE.text_scale, *GUIDANCE.interval
    out = np.zeros((b, w))
    for k in range(w):
        x, sig = per_step["x"][k], per_step["sigma"][k]
        v_c, v_u = (np.asarray(model.denoise(c.kv, c.mask, jnp.asarray(x), jnp.asarray(sig), ROLLOUT_GRID),
                               np.float64) for c in (cond, uncond))
        for i in range(b):
            sigma, nxt, smax = (float(per_step["sigma"][k, i]), float(per_step["sigma_next"][k, i]),
                                float(shared["sigma_max"][i]))
            e = V_TOL * max(np.abs(v_c[i]).max(), np.abs(v_u[i]).max())
            if lo < np.float32(sigma) <= hi:
                v = v_u[i] + s * (v_c[i] - v_u[i])
                f = min(max(np.linalg.norm(v_c[i]) / (np.linalg.norm(v) + 1e-8), GUIDANCE.renorm_min), 1.0)
                root_k = math.sqrt(v.size)
                df = root_k * e / np.linalg.norm(v_c[i]) + root_k * (2 * s + 1) * e / np.linalg.norm(v)
                err_v, v = (2 * s + 1) * e + np.abs(f * v).max() * df, f * v
            else:
                err_v, v = e, v_c[i]
            dt = nxt - sigma
            std = float(shared["noise_level"][i]) * math.sqrt(sigma / (1 - (smax if sigma == 1 else sigma)))
            x_coef, v_coef = 1 + std**2 * dt / (2 * sigma), (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
            mean = x[i] * x_coef + v * v_coef
            step_std = std * math.sqrt(-dt)
            z = (per_step["x_next"][k, i] - mean) / step_std
            terms = -(z**2) / 2 - math.log(step_std) - 0.5 * math.log(2 * math.pi)
            err_mean = abs(v_coef) * err_v + 8 * U * (abs(x_coef) * np.abs(x[i]).max() + np.abs(v * v_coef).max())
            out[i, k] = np.abs(z).mean() * err_mean / step_std + 2 * (z.size + 8) * U * np.abs(terms).mean()
    return out
