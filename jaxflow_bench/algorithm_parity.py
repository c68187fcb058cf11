"""Algorithm parity on CPU (float32): GRPO-Guard and rollout correction's loss of one window step, and its gradient
with respect to the step's log-probs and SDE means, against the reference transcriptions in
tests/reference_transcriptions.py, on identical inputs (a micro-batch of samples at different SDE steps, the
project's per-sample windows). Writes benchmarks/results/algorithm_parity.json; tests/test_algorithm_parity.py
asserts the same figures.

    PYTHONPATH=$PWD python -m jaxflow_bench.algorithm_parity [--out benchmarks/results]
"""
from __future__ import annotations

import argparse
import functools
import platform

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxflow.algorithms import flowgrpo, rollout_correction
from jaxflow_bench.results import write_result
from tests import reference_transcriptions as ref

B, S, C = 8, 16, 4
CLIP, ADV_CLIP, BETA = 2e-6, 5.0, 0.04


def inputs(seed: int = 0) -> dict:
    """float32 numpy inputs: per-sample sigma > sigma_next (different steps), std_dev_t, means, log-probs."""
    r = np.random.default_rng(seed)
    sigma = np.sort(r.uniform(0.3, 0.95, B)).astype(np.float32)
    f32 = functools.partial(np.asarray, dtype=np.float32)
    return {"sigma": sigma, "sigma_next": f32(sigma - r.uniform(0.05, 0.12, B)),
            "std": f32(r.uniform(0.5, 1.2, B)), "mean": f32(r.normal(size=(B, S, C))),
            "old_mean": None, "ref_mean": None, "logp": f32(r.normal(0, 1e-4, B) - 1.3),
            "advantages": f32(r.normal(size=B) * 2),
            "drift": f32(r.normal(0, 2e-3, (B, S, C))), "ref_drift": f32(r.normal(0, 1e-2, (B, S, C))),
            "dlogp": f32(r.normal(0, 0.5, B))}


def _project(x: dict, *, ratio_norm: str, guard_stats: str = "sample", reject=None, beta: float = 0.0):
    """(loss, (d loss / d logp, d loss / d mean)) of `flowgrpo.window_step_terms` + `window_loss`."""
    old_mean = jnp.asarray(x["mean"] - x["drift"])
    ref_mean = jnp.asarray(x["mean"] - x["ref_drift"])

    def loss(logp, mean):
        def log_prob(model, tr, lora_scale=1.0):
            return (mean if lora_scale else ref_mean), logp, jnp.asarray(x["std"])
        old_logp = jnp.asarray(x["logp"]) - jnp.asarray(x["dlogp"]) if reject is not None else jnp.asarray(x["logp"])
        tr = {"sigma": jnp.asarray(x["sigma"]), "sigma_next": jnp.asarray(x["sigma_next"]),
              "advantages": jnp.asarray(x["advantages"]), "rollout_log_prob": old_logp, "old_log_prob": old_logp,
              "old_mean": old_mean}
        terms = flowgrpo.window_step_terms(None, tr, grid_hw=None, sde_type="sde", guidance=1.0, clip_range=CLIP,
                                           adv_clip=ADV_CLIP, beta=beta, reject=reject, ratio_norm=ratio_norm,
                                           guard_stats=guard_stats, log_prob=log_prob)
        return flowgrpo.window_loss(terms, beta)

    # logp - logp_old of the old policy's sample: the Gaussian terms' difference, here a small offset
    logp = jnp.asarray(x["logp"])
    value, grads = jax.value_and_grad(loss, argnums=(0, 1))(logp, jnp.asarray(x["mean"]))
    return np.float32(value), tuple(np.asarray(g) for g in grads)


def _torch(fn, x: dict, **kw):
    logp = torch.tensor(x["logp"], requires_grad=True)
    mean = torch.tensor(x["mean"], requires_grad=True)
    value = fn(logp, mean, **kw)
    value.backward()
    return np.float32(value.item()), (logp.grad.numpy(), mean.grad.numpy())


def _guard_ref(fn, x):
    def run(logp, mean):
        sqrt_dt = torch.sqrt(torch.tensor(x["sigma"] - x["sigma_next"]))
        return fn(torch.tensor(x["logp"]), logp, torch.tensor(x["advantages"]),
                  torch.tensor(x["mean"] - x["drift"]), mean, torch.tensor(x["std"]), sqrt_dt, CLIP, ADV_CLIP)
    return _torch(run, x)


def _corrected_ref(x, option, threshold):
    def run(logp, mean):
        std = torch.tensor(x["std"])
        kl = ((mean - torch.tensor(x["mean"] - x["ref_drift"])) ** 2).mean(dim=(1, 2)) / (2 * std ** 2)
        return ref.verl_omni_bypass_flow_grpo_loss(logp, torch.tensor(x["logp"] - x["dlogp"]),
                                                   torch.tensor(x["advantages"]), CLIP, ADV_CLIP, option, threshold,
                                                   kl=kl, kl_coef=BETA)
    return _torch(run, x)


def differences(ours, theirs) -> dict:
    """max abs and rel difference of the loss and of the gradient (rel: over the reference's max |.|)."""
    (lo, go), (lt, gt) = ours, theirs
    g_abs = max(float(np.max(np.abs(a - b))) for a, b in zip(go, gt))
    g_scale = max(float(np.max(np.abs(b))) for b in gt)
    return {"loss_abs": abs(float(lo) - float(lt)), "loss_rel": abs(float(lo) - float(lt)) / abs(float(lt)),
            "grad_abs": g_abs, "grad_rel": g_abs / g_scale}


def figures(seed: int = 0) -> dict:
    """{algorithm/comparison: differences}."""
    x = inputs(seed)
    out = {
        "grpo_guard_batch_vs_verl_omni": differences(_project(x, ratio_norm="guard", guard_stats="batch"),
                                                     _guard_ref(ref.verl_omni_grpo_guard_loss, x)),
        "grpo_guard_sample_vs_verl_omni": differences(_project(x, ratio_norm="guard", guard_stats="sample"),
                                                      _guard_ref(ref.verl_omni_grpo_guard_loss, x)),
        "grpo_guard_batch_vs_flow_grpo": differences(_project(x, ratio_norm="guard", guard_stats="batch"),
                                                     _guard_ref(ref.flow_grpo_guard_policy_loss, x)),
    }
    for option, threshold in (("token_k1", 2.0), ("token_k2", 0.1), ("token_k3", 0.1)):
        reject = functools.partial(rollout_correction.keep_mask, option=option, threshold=threshold)
        out[f"rollout_corrected_{option}_vs_verl_omni_bypass"] = differences(
            _project(x, ratio_norm="none", reject=reject, beta=BETA), _corrected_ref(x, option, threshold))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    flat = {f"{k}/{m}": v for k, d in figures().items() for m, v in d.items()}
    path = write_result(args.out, "algorithm_parity", flat,
                        extra={"cpu": platform.processor() or platform.machine(), "dtype": "float32",
                               "inputs": f"B={B} samples at different SDE steps, S={S}, C={C}, seed 0"})
    for k, v in flat.items():
        print(f"{k}: {v:.3g}")
    print(path)


if __name__ == "__main__":
    main()
