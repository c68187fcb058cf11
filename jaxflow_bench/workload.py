"""The train-step benchmarks' workload: the recipe's family's (model.family) sizes (`FULL`, `TINY` for CPU code-path checks), the SDE window,
a Trajectory-shaped synthetic batch, the random-weight LoRA'd transformer, the recipe's train-step config, the shared
command-line flags and the step timer (scripts/bench_train_step.py, bench_minibatch.py, bench_scaling.py,
profile_step.py). JAX side.
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxflow.config import derived
from jaxflow import families
from jaxflow.nn.config import ModelOptions
from jaxflow.config import sections
from jaxflow.config.recipes import base
from jaxflow.trainer.step_config import TrainConfig
from jaxflow.trainer.train_batch import TrainBatch
from jaxflow_bench.timing import median_ms
from jaxflow_bridge.contract import schedule
from jaxflow_bridge.engines import families as torch_families

RECIPE = sections.build(base())  # the recipe, typed as the trainer reads it
FAMILY = families.of(RECIPE)
FULL = dict(num_layers=60, attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584)
TINY = dict(num_layers=2, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=64,
            axes_dims_rope=(8, 12, 12))
WINDOW = (3, 4)
# One optimizer update a step on the rollout's log-probs: the train step without the recipe's old-log-prob pass and
# second mini-batch (scripts/bench_minibatch.py times those).
ONE_UPDATE = dict(num_mini_batches=1, old_log_prob="rollout")


def recipe_train_config(grid_hw, **changes) -> TrainConfig:
    """The train step's config as the recipe ships it (`jaxflow.config.recipes.base()` through `jaxflow.config.validation.train_config`,
    as the trainer builds it) with a benchmark's own `changes` (micro-batches, mini-batches, ...)."""
    return dataclasses.replace(derived.train_config(RECIPE, grid_hw), **changes)


def synthetic_batch(cfg, args) -> dict:
    """A Trajectory-shaped batch with the real 10-step schedule; latents are random (timing only)."""
    rng = np.random.default_rng(0)
    b, s, w = args.batch, args.grid ** 2, len(WINDOW)
    sigmas = schedule.sigma_schedule(torch_families.spec(FAMILY.name).SCHEDULER_CONFIG, 10, s)
    neg = np.zeros((b, args.neg_txt), bool)
    neg[:, :5] = True
    return {
        "latents": rng.standard_normal((b, w + 1, s, cfg.in_channels), np.float32),
        "log_probs": np.full((b, w), -1.0, np.float32), "sigmas": sigmas,
        "step_index": np.tile(np.asarray(WINDOW, np.int32), (b, 1)), "noise_level": np.float32(1.2),
        "prompt_embeds": rng.standard_normal((b, args.txt, cfg.joint_attention_dim), np.float32),
        "prompt_mask": np.ones((b, args.txt), bool),
        "negative_prompt_embeds": rng.standard_normal((b, args.neg_txt, cfg.joint_attention_dim), np.float32),
        "negative_prompt_mask": neg, "advantages": rng.standard_normal(b).astype(np.float32),
    }


def negatives_padded(batch: dict, tokens: int) -> TrainBatch:
    """`batch` (`synthetic_batch`'s) as the train step's batch, its negative prompt embeds and mask right-padded (or
    cut, past their last real token) to `tokens`, as the engine pads them for the trainer
    (TrajectoryBatch.padded to config.text_tokens). At the prompts' length (--txt) the train step runs both in one
    batched call, as the recipe does; shorter, the negatives get a forward of their own."""
    emb, mask = batch["negative_prompt_embeds"], batch["negative_prompt_mask"]
    if tokens < int(mask.sum(axis=1).max()):
        raise ValueError(f"{tokens} negative tokens are fewer than the negatives' {int(mask.sum(axis=1).max())}")
    emb, mask = emb[:, :tokens], mask[:, :tokens]
    pad = tokens - emb.shape[1]
    return TrainBatch(**{**batch, "negative_prompt_embeds": np.pad(emb, ((0, 0), (0, pad), (0, 0))),
                         "negative_prompt_mask": np.pad(mask, ((0, 0), (0, pad)))})


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload flags of scripts/bench_train_step.py, shared with bench_minibatch.py and bench_scaling.py."""
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--grid", type=int, default=32)
    p.add_argument("--txt", type=int, default=128)
    p.add_argument("--neg-txt", type=int, default=8)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--layers", type=int, help="blocks of the full model (default 60): fewer for quick diagnostics")


def time_steps(step, state, batch, args) -> tuple[float, object]:
    """Median ms of `state, metrics = step(state, batch)` (state donated each call) and the last state."""
    holder = {"s": state}

    def one():
        holder["s"], metrics = step(holder["s"], batch)
        return metrics
    return median_ms(one, args.warmup, args.iters, jax.block_until_ready), holder["s"]


def random_model(cfg, rank: int, remat: str = "save_matmuls", attention: str = "auto"):
    """(model, spec): the bf16 transformer with LoRA r=rank (alpha 2r), random weights drawn on the device."""
    spec = FAMILY.lora_spec_type(rank=rank, alpha=2.0 * rank)
    opts = ModelOptions(dtype="bfloat16", param_dtype="bfloat16", remat=remat, attention=attention)
    abstract = nnx.eval_shape(lambda: FAMILY.model_type(cfg, opts, spec, rngs=nnx.Rngs(0)))
    state = jax.jit(lambda: nnx.state(FAMILY.model_type(cfg, opts, spec, rngs=nnx.Rngs(0))))()
    return nnx.merge(nnx.graphdef(abstract), state), spec
