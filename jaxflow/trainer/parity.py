"""Rollout/trainer log-prob parity: recompute a TrajectoryBatch's window log-probs the way the train step does.

`recompute` runs `flowgrpo_step.accumulate_gradients` (prepare_batch -> micro-batches -> `flowgrpo.window_steps` ->
`flowgrpo.window_step_terms`) under jit and keeps only its per-sample terms, so XLA drops the backward pass
and what remains is the train step's own forward: sigma / sigma_next / sigma_max from the stored schedule and
step_index, the stored latents, text embeds and masks, true CFG when guidance > 1. `parity_stats` summarises
|dlogp| = |logp_jax - logp_rollout| per window position. Never imports torch.
"""
from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxflow.nn.lora import LoRAParam, LoRASpec
from jaxflow import families
from jaxflow.trainer.minibatches import RowLayout
from jaxflow.trainer.step_config import TrainConfig
from jaxflow.trainer.train_batch import TrainBatch
from jaxflow.algorithms.flowgrpo_step import accumulate_gradients
from jaxflow.trainer.train_step import prepare_batch
from jaxflow_bridge.contract.trajectory import TrajectoryBatch


def recompute(model: nnx.Module, batch: TrajectoryBatch, *, grid_hw: tuple[int, int], guidance: float,
              sde_type: str, noise_level: float, num_micro_batches: int = 1, **cfg) -> dict[str, np.ndarray]:
    """(B, W) arrays: log_prob (JAX), dlogp = log_prob - batch.log_probs, ratio = exp(dlogp). `cfg`: a family's CFG
    fields of TrainConfig (cfg_interval, cfg_renorm_min); the model's family picks the log-prob (`Family.objective`)."""
    config = TrainConfig(grid_hw=grid_hw, sde_type=sde_type, guidance=guidance,
                         num_micro_batches=num_micro_batches, **cfg)
    b = len(batch.log_probs)
    if batch.guided and batch.negative_prompt_mask.shape[1] > batch.prompt_mask.shape[1]:  # as the rollout ran them
        batch = batch.padded((batch.negative_prompt_mask.shape[1],) * 2)
    arrays = prepare_batch(TrainBatch.of(batch, np.zeros(b, np.float32), noise_level), config)
    graphdef, lora, frozen = nnx.split(model, LoRAParam, ...)
    objective = families.of_model(model).objective(config)
    terms = jax.jit(lambda lo, fr, ba: accumulate_gradients(graphdef, lo, fr, ba, config, objective=objective)[1])(
        lora, frozen, arrays)

    def rows(t):  # the (M, W, B/M) micro-batch stack back in batch rows (B, W)
        return RowLayout(1, num_micro_batches).unstack(np.asarray(t, np.float64), axis=2)

    dlogp = rows(terms["dlogp"])
    return {"log_prob": batch.log_probs + dlogp, "dlogp": dlogp, "ratio": rows(terms["ratio"])}


def random_adapter(folder: str | Path, spec: LoRASpec, seed: int, scale: float = 0.05,
                   round_to=None, *, drawn: str | Path | None = None) -> dict[str, np.ndarray]:
    """A random, non-zero PEFT adapter on `spec`'s targets for a model folder of `spec`'s family (its
    `weights_source`: e.g. a diffusers `transformer/` folder), shapes from the safetensors headers (touches no
    accelerator); with `drawn`, a model folder whose base weights are drawn (model.init=random), shapes from its
    config (`Family.random_weights`), so that folder need hold no transformer weights.
    A has std 1/sqrt(in) and B std scale sqrt(r) / alpha, so each adapted layer adds about `scale` x the input's RMS
    to every output. `round_to` (e.g. ml_dtypes.bfloat16) rounds the values, so a low-precision engine holds
    exactly what JAX holds."""
    family = families.of_lora_spec(spec)
    if drawn is None:
        source, layers = family.weights_source(Path(folder))
        shape = source.shape
    else:
        shape = {key: s for key, s, _ in family.random_weights(Path(drawn))}.__getitem__
        layers = family.num_layers(Path(drawn))
    entries = spec.key_map()
    keys = sorted(k for e in entries for k in e.diffusers_keys(layers))
    rng = np.random.default_rng(seed)
    out = {}
    for key in keys:
        module, part, _ = key.rsplit(".", 2)
        fan_out, fan_in = shape(f"{module}.weight")
        if part == "lora_A":
            value = rng.standard_normal((spec.rank, fan_in)) / np.sqrt(fan_in)
        else:
            value = rng.standard_normal((fan_out, spec.rank)) * scale * np.sqrt(spec.rank) / spec.alpha
        out[key] = np.asarray(value if round_to is None else value.astype(round_to), np.float32)
    return out


def _summary(dlogp: np.ndarray, ratio: np.ndarray) -> dict[str, float]:
    d = np.abs(dlogp)
    return {"mean": float(d.mean()), "p50": float(np.percentile(d, 50)), "p99": float(np.percentile(d, 99)),
            "max": float(d.max()), "ratio_mean": float(ratio.mean()), "ratio_min": float(ratio.min()),
            "ratio_max": float(ratio.max())}


def parity_stats(dlogp: np.ndarray, ratio: np.ndarray) -> dict:
    """|dlogp| mean/p50/p99/max and ratio mean/min/max per window position (over samples) and overall."""
    return {"per_step": [_summary(dlogp[:, k], ratio[:, k]) for k in range(dlogp.shape[1])],
            "overall": _summary(dlogp, ratio)}
