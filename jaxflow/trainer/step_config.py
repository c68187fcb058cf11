"""The train step's static configuration (`TrainConfig`, flow_grpo's defaults; docs/numerics.md §4, §10) with the
algorithm it resolves to (`TrainConfig.policy`, `jaxflow.algorithms.registry`), and its state (`TrainState`). The step
itself is `jaxflow.trainer.train_step`."""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import optax
from flax import nnx

from jaxflow.algorithms import registry

@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Static configuration of the step (flow_grpo defaults, `config/base.py`; docs/numerics.md §4)."""

    grid_hw: tuple[int, int]
    sde_type: str = "sde"
    # sample.guidance (no default here: the recipe's, jaxflow/config/recipes.py); > 1: true CFG in the training
    # forward (a family's text CFG: its scale)
    guidance: float = dataclasses.field(kw_only=True)
    cfg_interval: tuple[float, float] = (0.0, 1.0)  # a family's text CFG at steps with lo < sigma <= hi
    cfg_renorm_min: float = 0.0     # a family's text CFG: floor of its renorm factor
    num_micro_batches: int = 1     # per update (per mini-batch)
    num_mini_batches: int = 1      # optimizer updates per pass over the batch
    num_inner_epochs: int = 1      # passes over the batch
    clip_range: float = 1e-4
    beta: float = 0.0              # KL weight; 0 skips the reference forward
    adv_clip: float = 5.0
    learning_rate: float = 3e-4
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 1e-4
    max_grad_norm: float = 1.0
    ema_decay: float | None = None  # EMA of the LoRA params; None = off
    old_log_prob: str = "rollout"   # "recompute": logp_old from the trainer; "rollout_corrected": see below
    # old_log_prob="rollout_corrected" (verl's rollout-correction bypass mode with rejection): logp_old is the
    # rollout's and a sample's window step is rejected by verl's estimator rollout_rs at threshold t = this
    # (token_k1: exp(logp - logp_rollout) outside [1/t, t]; jaxflow.algorithms.rollout_correction)
    rejection_threshold: float = 2.0
    rollout_rs: str = "token_k1"
    # "recompute_corrected" (verl's decoupled mode): truncated IS weights "token" / "sequence" of logp_old -
    # logp_rollout at rollout_is_threshold ("off": none), and rollout_rs ("off" or any, seq_* over a sample)
    rollout_is: str = "off"
    rollout_is_threshold: float = 2.0
    ratio_norm: str = "none"        # "guard": GRPO-Guard's normalized ratio (jaxflow.algorithms.grpo_guard)
    guard_stats: str = "sample"     # guard: each sample's own step's scale and dt, or "batch": the micro-batch's
    guard_clip_range: float = 2e-6  # guard: the clip of its normalized ratio (both references' recipes)
    off_policy: bool = False        # batches may come from the previous policy (rollout.overlap): see `__call__`
    drop_zero_advantage: bool = False  # drop rows whose advantage is 0 (algorithms.zero_advantage)
    shuffle_seed: int = 0           # the rows' shuffle between inner epochs; with "nft" also its timesteps and noise
    # the policy loss (jaxflow.algorithms.registry): "flowgrpo", or "nft" (DiffusionNFT, jaxflow.algorithms.nft)
    algorithm: str = "flowgrpo"
    nft_beta: float = 0.1
    nft_timesteps: int = 1
    nft_decay: tuple[float, float, float] = (75, 0.0075, 0.999)
    # "mixgrpo" (jaxflow.algorithms.mixgrpo): the window moves by mixgrpo_stride steps every mixgrpo_interval steps
    mixgrpo_interval: int = 25
    mixgrpo_stride: int = 1
    # "awm" (jaxflow.algorithms.awm; its OCR recipe's values)
    awm_timesteps: int = 6
    awm_fraction: float = 0.9
    awm_power: float = 0.25
    awm_adv_max: float = 1.0
    awm_clip_range: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "grid_hw", tuple(int(s) for s in self.grid_hw))
        object.__setattr__(self, "nft_decay", tuple(float(x) for x in self.nft_decay))
        object.__setattr__(self, "cfg_interval", tuple(float(x) for x in self.cfg_interval))
        bad = next(((name, why) for name, fails, why in self._rules() if fails), None)
        if bad:
            raise ValueError(f"TrainConfig.{bad[0]}={getattr(self, bad[0])!r}; {bad[1]}")

    def _rules(self):
        """(field, fails, why) for every rule on the fields, in the order they are checked: the one place they are
        written (jaxflow.config.validation.validate reports the first failing one under its config key). The algorithm keys'
        choices come first, the resolved policy's own rules (`registry.Policy.rules`) last."""
        choices = registry.choice_rules(self)
        general = (
            ("guidance", self.guidance < 1, "must be >= 1 (1: no CFG)"),
            ("cfg_interval", not (len(self.cfg_interval) == 2 and 0 <= self.cfg_interval[0] <= self.cfg_interval[1]
                                  <= 1), "(lo, hi) with 0 <= lo <= hi <= 1"),
            ("cfg_renorm_min", not 0 <= self.cfg_renorm_min <= 1, "must be in [0, 1]"),
            ("clip_range", not self.clip_range > 0, "must be > 0"),
            ("beta", not self.beta >= 0, "must be >= 0 (0: no KL term)"),
            ("learning_rate", not self.learning_rate > 0, "must be > 0"),
            ("num_micro_batches", self.num_micro_batches < 1, "must be >= 1"),
            ("num_mini_batches", self.num_mini_batches < 1, "must be >= 1"),
            ("num_inner_epochs", self.num_inner_epochs < 1, "must be >= 1"),
            ("adam_b1", not 0 <= self.adam_b1 < 1, "must be in [0, 1)"),
            ("adam_b2", not 0 <= self.adam_b2 < 1, "must be in [0, 1): adam_b2 < 1"),
            ("adam_eps", not self.adam_eps > 0, "must be > 0"),
            ("ema_decay", self.ema_decay is not None and not 0 < self.ema_decay < 1, "must be in (0, 1), or None"))
        if any(fails for _, fails, _ in choices):
            return choices + general
        return choices + general + self.policy.rules(self)

    @property
    def policy(self) -> registry.Policy:
        """The algorithm's components, one per role (`jaxflow.algorithms.registry.resolve`)."""
        return registry.resolve(self)

    @property
    def batch_fields(self) -> tuple[str, ...]:
        """The per-sample fields the step reads (the policy loss's)."""
        return self.policy.loss.batch_fields(self)

    @property
    def guided(self) -> bool:
        """True classifier-free guidance is on: batches carry the negative prompt (train_batch.GUIDANCE_FIELDS)."""
        return self.guidance > 1

    @property
    def updates(self) -> int:
        return self.num_inner_epochs * self.num_mini_batches

    @property
    def pass_skips_first(self) -> bool:
        """Whether the recompute pass leaves out mini-batch 0 (one inner epoch, on-policy: its update is the first
        and its own logp is logp_old)."""
        return self.num_inner_epochs == 1 and not self.off_policy and not self.policy.old_log_prob.every_row

    @property
    def recompute_pass(self) -> bool:
        """Whether `step` runs the forward-only old-log-prob pass before its updates."""
        return self.policy.recompute and (self.updates > 1 or self.off_policy or self.policy.old_log_prob.every_row)

    def optimizer(self) -> optax.GradientTransformation:
        return optax.chain(
            optax.clip_by_global_norm(self.max_grad_norm),
            optax.adamw(self.learning_rate, b1=self.adam_b1, b2=self.adam_b2, eps=self.adam_eps,
                        weight_decay=self.weight_decay))


@flax.struct.dataclass
class TrainState:
    """step = applied updates; lora = the LoRAParam state; opt_state over lora only; ema = EMA of lora or None;
    old = DiffusionNFT's old policy (the one the rollout samples with) or None."""

    step: jax.Array
    lora: nnx.State
    opt_state: optax.OptState
    ema: nnx.State | None = None
    old: nnx.State | None = None
