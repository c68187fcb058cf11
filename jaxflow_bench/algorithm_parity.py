"""Algorithm parity on CPU (float32): GRPO-Guard and rollout correction's loss of one window step, and its gradient
with respect to the step's log-probs and SDE means, against the reference transcriptions in
tests/reference_transcriptions.py, on identical inputs (a micro-batch of samples at different SDE steps, the
project's per-sample windows); and the zero-advantage filter's updates (`flowgrpo_step.accumulate_gradients`'s loss
and gradient with respect to a stand-in policy's one LoRA weight) against flow_grpo's SD3 trainer's filtering and
loss averaging; and decoupled rollout correction's IS and RS variants (`accumulate_gradients`' loss and
gradient) against verl's helpers' transcription; with `flow_matching_parity`'s figures (DiffusionNFT, AWM) and
`sampling_parity`'s (FlowGRPO's SDE step, MixGRPO's window schedule and Flash sampler). Writes
benchmarks/results/algorithm_parity.json; tests/algorithms/test_algorithm_parity.py asserts the same figures.

    PYTHONPATH=$PWD python -m jaxflow_bench.algorithm_parity [--out benchmarks/results]
"""
from __future__ import annotations

import argparse
import functools
import platform
import shlex
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from jaxflow.algorithms import flowgrpo, rollout_correction
from jaxflow.algorithms.flowgrpo_step import accumulate_gradients
from jaxflow.algorithms.objective import Objective
from jaxflow.nn.lora import LoRAParam
from jaxflow.trainer import minibatches
from jaxflow.trainer.step_config import TrainConfig
from jaxflow_bench import flow_matching_parity, sampling_parity
from jaxflow_bench.parity_differences import differences
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


ZB, ZW, ZS, ZC, ZCLIP = 16, 2, 8, 4, 0.02  # the filter's comparison: rows, window steps, tokens, channels, clip
# (M, m) of the project, (num_batches_per_epoch, gradient_accumulation_steps) of flow_grpo: the same rows per update;
# the project's micro-batches of the last two are partly filled (3 of 4 rows kept; 4 and 2 of 4)
ZERO_LAYOUTS = {"one_micro_batch": ((1, 1), (2, 2)), "two_mini_two_micro": ((2, 2), (2, 1)),
                "one_mini_four_micro": ((1, 4), (3, 3))}


class Drift(nnx.Module):
    """A stand-in policy for the filter's comparison: the SDE step's mean is x + p, p (S, C) its one LoRA weight."""

    def __init__(self, p):
        self.p = LoRAParam(jnp.asarray(p))


def drift_log_prob(model, tr, config, lora_scale=1.0):
    mean = tr["x"] + lora_scale * model.p[...]
    std = tr["sigma"]
    return mean, -jnp.mean((tr["x_next"] - mean) ** 2, axis=(1, 2)) / (2 * std ** 2), std


def zero_inputs(seed: int = 0) -> dict:
    """float32 numpy rows: rows 0-5 with advantages (M = 2 deals 3 to each mini-batch), rows 6-15 at 0."""
    r = np.random.default_rng(seed)
    f32 = functools.partial(np.asarray, dtype=np.float32)
    sigmas = np.tile(f32([1.0, 0.8, 0.6, 0.4]), (ZB, 1))
    step_index = np.stack([np.arange(ZW) + (i % 2) for i in range(ZB)]).astype(np.int32)  # rows at different steps
    latents = f32(r.normal(size=(ZB, ZW + 1, ZS, ZC)))
    p0 = f32(r.normal(0, 0.1, (ZS, ZC)))
    sigma = sigmas[np.arange(ZB)[:, None], step_index]
    mean = latents[:, :-1] + p0
    logp = -np.mean((latents[:, 1:] - mean) ** 2, axis=(2, 3)) / (2 * sigma ** 2)
    advantages = np.where(np.arange(ZB) < 6, r.normal(0, 1.5, ZB), 0.0)
    return {"latents": latents, "sigmas": sigmas, "step_index": step_index, "p0": p0,
            "log_probs": f32(logp + r.normal(0, 0.02, logp.shape)), "advantages": f32(advantages)}


def _zero_project(x: dict, mini: int, micro: int):
    """[(loss, (grad,))] of each update: the batch compacted as the driver does, `accumulate_gradients` per
    mini-batch at the same LoRA."""
    config = TrainConfig(guidance=1.0, grid_hw=(1, 1), clip_range=ZCLIP, beta=BETA, num_mini_batches=mini,
                         num_micro_batches=micro, drop_zero_advantage=True)
    order = minibatches.zero_advantage_order(x["advantages"], mini, micro)
    batch = {k: jnp.asarray(x[k][order]) for k in ("latents", "sigmas", "step_index", "log_probs", "advantages")}
    graphdef, lora, frozen = nnx.split(Drift(x["p0"]), LoRAParam, ...)
    objective = Objective(lambda model, shared, config: shared, drift_log_prob)
    out = []
    for j in range(mini):
        grads, terms = accumulate_gradients(graphdef, lora, frozen, minibatches.select(batch, mini, j), config,
                                            objective=objective)
        loss = flowgrpo.step_metrics(terms, clip_range=ZCLIP, beta=BETA)["loss"]
        out.append((np.float32(loss), (np.asarray(grads["p"][...]),)))
    return out


def _zero_reference(x: dict, mini: int, batches: int, accumulation: int):
    """[(loss, (grad,))] of each of flow_grpo's updates, its shuffle dealing the project's mini-batch j's kept rows
    to update j (in a random order inside it)."""
    r = np.random.default_rng(1)
    kept = np.flatnonzero(x["advantages"] != 0)  # the rows flow_grpo keeps, in their order
    perm = np.concatenate([r.permutation(np.flatnonzero(kept % mini == j)) for j in range(mini)])
    samples = {k: torch.tensor(x[k]) for k in ("latents", "log_probs")}
    samples["sigma"] = torch.tensor(np.take_along_axis(x["sigmas"], x["step_index"], 1))
    samples["advantages"] = torch.tensor(np.repeat(x["advantages"][:, None], ZW, 1))
    p = torch.tensor(x["p0"], requires_grad=True)

    def compute_log_prob(sample, j, adapter):
        xt, std = sample["latents"][:, j], sample["sigma"][:, j]
        mean = xt + p if adapter else xt
        logp = -((sample["latents"][:, j + 1] - mean) ** 2).mean(dim=(1, 2)) / (2 * std ** 2)
        return logp, mean, std[:, None, None]

    losses = ref.flow_grpo_sd3_filtered_updates(samples, compute_log_prob, batches, accumulation, ZCLIP, ADV_CLIP,
                                                BETA, torch.tensor(perm))
    out = []
    for loss in losses:
        p.grad = None
        loss.backward()
        out.append((np.float32(loss.item()), (p.grad.numpy().copy(),)))
    return out


def zero_advantage_figures(seed: int = 0) -> dict:
    """{layout: the largest differences over the updates} of the filter against flow_grpo's SD3 trainer."""
    x, out = zero_inputs(seed), {}
    for name, ((mini, micro), (batches, accumulation)) in ZERO_LAYOUTS.items():
        pairs = zip(_zero_project(x, mini, micro), _zero_reference(x, mini, batches, accumulation), strict=True)
        diffs = [differences(ours, theirs) for ours, theirs in pairs]
        out[f"zero_advantage_{name}_vs_flow_grpo_sd3"] = {k: max(d[k] for d in diffs) for k in diffs[0]}
    return out


# decoupled rollout correction's variants: (rollout_is, rollout_rs, rejection_threshold), "off" for none
DECOUPLED = {"is_token": ("token", "off", 2.0), "is_sequence": ("sequence", "off", 2.0),
             "is_sequence_rs_seq_mean_k3": ("sequence", "seq_mean_k3", 0.02),
             **{f"rs_{o}": ("off", o, 1.3 if o.endswith("k1") else 0.03 if o.startswith("seq_sum") else 0.015)
                for o in rollout_correction.RS_OPTIONS}}


def decoupled_inputs(seed: int = 0) -> dict:
    """`zero_inputs`' rows, every advantage non-zero; old_log_probs near the policy's logp (the recompute pass's),
    log_probs (the rollout's) off them by N(0, 0.15) per window step."""
    x = zero_inputs(seed)
    r = np.random.default_rng(seed + 1)
    x["advantages"] = np.asarray(r.normal(0, 1.5, ZB), np.float32)
    x["old_log_probs"] = x["log_probs"]
    x["log_probs"] = np.asarray(x["log_probs"] + r.normal(0, 0.15, x["log_probs"].shape), np.float32)
    return x


def decoupled_config(rollout_is: str, rollout_rs: str, threshold: float) -> TrainConfig:
    return TrainConfig(guidance=1.0, grid_hw=(1, 1), clip_range=ZCLIP, beta=0.0, num_micro_batches=2,
                       old_log_prob="recompute_corrected", rollout_is=rollout_is, rollout_rs=rollout_rs,
                       rejection_threshold=threshold)


def _decoupled_project(x: dict, config: TrainConfig):
    """(loss, (grad,)) of `accumulate_gradients` on the rows with logp_old given (the recompute pass's)."""
    batch = {k: jnp.asarray(x[k]) for k in ("latents", "sigmas", "step_index", "log_probs", "old_log_probs",
                                            "advantages")}
    graphdef, lora, frozen = nnx.split(Drift(x["p0"]), LoRAParam, ...)
    grads, terms = accumulate_gradients(graphdef, lora, frozen, batch, config,
                                        objective=Objective(lambda model, shared, config: shared, drift_log_prob))
    loss = flowgrpo.step_metrics(terms, clip_range=ZCLIP, beta=0.0)["loss"]
    return np.float32(loss), (np.asarray(grads["p"][...]),)


def _decoupled_reference(x: dict, rollout_is: str, rollout_rs: str, threshold: float):
    p = torch.tensor(x["p0"], requires_grad=True)
    latents = torch.tensor(x["latents"])
    sigma = torch.tensor(np.take_along_axis(x["sigmas"], x["step_index"], 1))
    logp = torch.stack([-((latents[:, j + 1] - latents[:, j] - p) ** 2).mean(dim=(1, 2)) / (2 * sigma[:, j] ** 2)
                        for j in range(ZW)], dim=1)
    loss = ref.verl_decoupled_flow_grpo_loss(
        logp, torch.tensor(x["old_log_probs"]), torch.tensor(x["log_probs"]),
        torch.tensor(x["advantages"])[:, None], ZCLIP, ADV_CLIP, None if rollout_is == "off" else rollout_is,
        2.0, None if rollout_rs == "off" else rollout_rs, threshold)
    loss.backward()
    return np.float32(loss.item()), (p.grad.numpy(),)


def decoupled_figures(seed: int = 0) -> dict:
    """{variant: differences} of decoupled rollout correction against verl's helpers' transcription."""
    x = decoupled_inputs(seed)
    return {f"recompute_corrected_{name}_vs_verl": differences(_decoupled_project(x, decoupled_config(*v)),
                                                                 _decoupled_reference(x, *v))
            for name, v in DECOUPLED.items()}


def loss_figures(seed: int = 0) -> dict:
    """{algorithm/comparison: differences} of the losses, steps and samplers (a few seconds on a CPU)."""
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
    return {**out, **flow_matching_parity.figures(seed), **sampling_parity.figures()}


def update_figures(seed: int = 0) -> dict:
    """{comparison: differences} of whole updates through `accumulate_gradients` (the zero-advantage filter's
    layouts, decoupled rollout correction's variants; about half a minute on a CPU)."""
    return {**zero_advantage_figures(seed), **decoupled_figures(seed)}


def figures(seed: int = 0) -> dict:
    """{algorithm/comparison: differences}, every comparison."""
    return {**loss_figures(seed), **update_figures(seed)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    flat = {f"{k}/{m}": v for k, d in figures().items() for m, v in d.items()}
    path = write_result(args.out, "algorithm_parity", flat,
                        command=shlex.join(["python", "-m", "jaxflow_bench.algorithm_parity", *argv]),
                        extra={"cpu": platform.processor() or platform.machine(), "dtype": "float32",
                               "inputs": f"B={B} samples at different SDE steps, S={S}, C={C}, seed 0; zero-advantage "
                                         f"filter: {ZB} rows (10 at advantage 0) x {ZW} window steps, S={ZS}, "
                                         f"C={ZC}; NFT 5 samples, AWM 6, S x C = 24 and 128; SDE step 4 samples at "
                                         f"steps {sampling_parity.STEP_INDICES.tolist()} of 10; Flash "
                                         f"{len(sampling_parity.FLASH_STARTS)} samples x {sampling_parity.FLASH_STEPS} "
                                         f"steps; windows over {len(sampling_parity.WINDOW_GRID)} schedule settings"})
    for k, v in flat.items():
        print(f"{k}: {v:.3g}" if isinstance(v, float) else f"{k}: {v}")
    print(path)


if __name__ == "__main__":
    main()
