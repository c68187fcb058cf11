"""What the validated config gives the trainer and the rollout: the typed components built from its sections (the
train step's TrainConfig, the model's options, XLA's options, the LoRA spec, the sharding, the rollout's sampling
params, the text lengths the batch pads to). The rules live in validation.py; these only build."""
from __future__ import annotations

from jaxflow import families
from jaxflow.config.errors import fail
from jaxflow.nn.config import ModelOptions
from jaxflow.nn.lora import LoRASpec
from jaxflow.trainer.sharding import ShardingConfig
from jaxflow.trainer.step_config import TrainConfig


def nft_timesteps(cfg) -> int:
    """Timesteps trained a sample with train.algorithm='nft': train.nft.timesteps, 0 = DiffusionNFT's default
    int(0.99 sample.num_steps)."""
    return cfg.train.nft.timesteps or max(1, int(cfg.sample.num_steps * 0.99))


def text_tokens(cfg) -> tuple[int, int]:
    """(prompt, negative prompt) tokens the train batch pads text to: sample.max_sequence_length (plus
    sample.max_think_tokens with a family's think mode, sample.think: the think tokens, start token included, follow the
    prompt's context), and sample.negative_max_sequence_length or, where that is 0, sample.max_sequence_length; each
    plus the tokens of the family's conditioning images (`Family.vision_tokens`: an edit prompt's reference images,
    which both prompts see). Negatives shorter than prompts run as their own forward in the train step
    (`flowgrpo.guided_velocity`)."""
    s, images = cfg.sample, families.of(cfg).vision_tokens(cfg)
    return (s.max_sequence_length + (s.max_think_tokens if s.think else 0) + images,
            (s.negative_max_sequence_length or s.max_sequence_length) + images)


def model_options(cfg, gemm: str | None, num_layers: int) -> ModelOptions:
    """The config's ModelOptions for a model of `num_layers` blocks; `gemm` is model.lora_gemm resolved
    (`lora_gemm`), needed when it is "auto".

    model.scan_unroll=0 (the recipe's) unrolls the blocks where the linears run "pallas" and scans them otherwise:
    unrolled blocks pay with the fused kernel (BENCHMARKS.md, the recipe on one GPU), and with XLA's linears their
    update holds about twice the scan's temporaries, which did not fit beside the engine on 2 H200s (docs/design.md,
    the scan and the unrolled blocks)."""
    m = cfg.model
    gemm = gemm or m.lora_gemm
    if gemm == "auto":
        raise ValueError("model.lora_gemm='auto' must be resolved first (jaxflow/config/plan.py lora_gemm)")
    unroll = m.scan_unroll or (num_layers if gemm == "pallas" else 1)
    return ModelOptions(dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat, attention=m.attention,
                        scan_unroll=unroll, matmul_precision=m.matmul_precision, lora_gemm=gemm)


# With model.lora_gemm=pallas, XLA's dynamic-slice fusion runs every fused linear whose output the scan stacks for
# the backward twice (BENCHMARKS.md, the fused LoRA GEMM): off unless train.xla_options sets it.
PALLAS_XLA_OPTIONS = {"xla_gpu_enable_dynamic_slice_fusion": False}


def xla_options(cfg, gemm: str | None = None) -> dict:
    """train.xla_options: XLA debug options for the train step's jits only (never process-wide), plus
    PALLAS_XLA_OPTIONS where the linears run "pallas" (`gemm`, model.lora_gemm resolved) and the user did not set
    them."""
    opts = dict(cfg.train.xla_options)
    bad = sorted(k for k in opts if not k.startswith("xla_"))
    if bad:
        fail("train.xla_options", f"{bad} are not XLA options (names start with 'xla_', e.g. "
                                   f"xla_gpu_enable_triton_gemm)")
    if (gemm or cfg.model.lora_gemm) == "pallas":
        opts = {**PALLAS_XLA_OPTIONS, **opts}
    return opts


def lora_spec(cfg) -> LoRASpec:
    """The family's LoRA spec (lora.rank, lora.alpha, lora.targets in its names)."""
    return families.of(cfg).lora_spec(cfg)


def sharding_config(cfg) -> ShardingConfig:
    s = cfg.sharding
    rules = tuple((name, tuple(axes) if isinstance(axes, (list, tuple)) else axes) for name, axes in s.rules)
    return ShardingConfig(data=s.data, fsdp=s.fsdp, tensor=s.tensor, rules=rules)


def train_config(cfg, grid_hw, num_micro_batches: int | None = None) -> TrainConfig:
    """The train step's settings; `num_micro_batches`: the plan's (`RunPlan.num_micro_batches`), which a config's
    train.num_micro_batches='auto' needs."""
    t, s = cfg.train, cfg.sample
    num_micro_batches = num_micro_batches or t.num_micro_batches
    if num_micro_batches == "auto":
        raise ValueError("TrainConfig.num_micro_batches='auto' is resolved by the plan stage: pass the plan's")
    nft = t.algorithm == "nft"  # its KL weight and EMA: train.nft.kl, train.nft.ema (docs/numerics.md §10)
    return TrainConfig(grid_hw=grid_hw, sde_type=s.sde_type, guidance=s.guidance,
                       cfg_interval=tuple(s.cfg_interval), cfg_renorm_min=s.cfg_renorm_min,
                       num_micro_batches=num_micro_batches, num_mini_batches=t.num_mini_batches,
                       num_inner_epochs=t.num_inner_epochs, clip_range=t.clip_range, beta=t.nft.kl if nft else t.beta,
                       adv_clip=t.adv_clip, learning_rate=t.learning_rate, weight_decay=t.weight_decay,
                       max_grad_norm=t.max_grad_norm, ema_decay=t.ema_decay or (t.nft.ema if nft else 0) or None,
                       old_log_prob=t.old_log_prob,
                       rejection_threshold=t.rejection_threshold, ratio_norm=t.ratio_norm,
                       rollout_rs=t.rollout_rs, rollout_is=t.rollout_is,
                       rollout_is_threshold=t.rollout_is_threshold, guard_stats=t.guard_stats, guard_clip_range=t.guard_clip_range,
                       off_policy=bool(cfg.rollout.overlap), drop_zero_advantage=t.drop_zero_advantage,
                       shuffle_seed=int(cfg.seed), algorithm=t.algorithm, nft_beta=t.nft.beta,
                       nft_timesteps=nft_timesteps(cfg),
                       nft_decay=(t.nft.decay_flat, t.nft.decay_rate, t.nft.decay_max),
                       mixgrpo_interval=t.mixgrpo.interval, mixgrpo_stride=t.mixgrpo.stride,
                       awm_timesteps=t.awm.timesteps, awm_fraction=t.awm.fraction, awm_power=t.awm.power,
                       awm_adv_max=t.awm.adv_max, awm_clip_range=t.awm.clip_range,
                       adam_b1=t.adam_b1, adam_b2=t.adam_b2, adam_eps=t.adam_eps)


def sampling(cfg, *, eval_mode: bool = False) -> dict:
    """Rollout SamplingParams as a plain dict in the family's keys (what crosses Ray); eval = ODE with the eval
    step count."""
    return families.of(cfg).sampling(cfg, eval_mode)


def eval_prompts_per_call(cfg) -> int:
    """Held-out prompts a rollout call of the eval (one image each): as many images a call as a training call's
    (sample.prompts_per_call x group_size), which the engine is known to hold."""
    return cfg.sample.prompts_per_call * cfg.sample.group_size


def embed_dtype(cfg):
    """The dtype of the text embeds the rollout hands the trainer: the rollout's own (bfloat16 or float32)."""
    import ml_dtypes
    import numpy as np
    return np.dtype(ml_dtypes.bfloat16) if cfg.rollout.dtype == "bfloat16" else np.dtype(cfg.rollout.dtype)
