"""The train step's static configuration (`TrainConfig`, flow_grpo's defaults; docs/numerics.md §4, §10), its state
(`TrainState`), and the train batch fields (`jaxflow.train_batch`) each algorithm reads. The step itself is `jaxflow.train_step`."""
from __future__ import annotations

import dataclasses

import flax.struct
import jax
import optax
from flax import nnx

BATCH_FIELDS = ("latents", "log_probs", "sigmas", "step_index", "noise_level", "prompt_embeds", "prompt_mask",
                "advantages")
GUIDANCE_FIELDS = ("negative_prompt_embeds", "negative_prompt_mask")
NFT_FIELDS = ("final_latents", "sigmas", "prompt_embeds", "prompt_mask", "advantages")
# BAGEL's batches carry the context's token ids (B, L) int32 in place of the embeds (docs/bagel.md §4)
TEXT_IDS = {"prompt_embeds": "prompt_ids", "negative_prompt_embeds": "negative_prompt_ids"}
OLD_LOG_PROBS = ("rollout", "recompute", "rollout_corrected")
RATIO_NORMS = ("none", "guard")
ALGORITHMS = ("flowgrpo", "nft")


def with_text_ids(fields: tuple[str, ...]) -> tuple[str, ...]:
    """`fields` with the text embeds replaced by the token ids (`TEXT_IDS`)."""
    return tuple(TEXT_IDS.get(f, f) for f in fields)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Static configuration of the step (flow_grpo defaults, `config/base.py`; docs/numerics.md §4)."""

    grid_hw: tuple[int, int]
    sde_type: str = "sde"
    guidance: float = 1.0          # > 1: true CFG in the training forward (BAGEL: its text CFG scale)
    cfg_interval: tuple[float, float] = (0.0, 1.0)  # BAGEL: text CFG at steps with lo < sigma <= hi
    cfg_renorm_min: float = 0.0     # BAGEL: floor of the CFG's per-sample renorm factor
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
    # rollout's and a sample's window step is rejected when exp(logp - logp_rollout) leaves [1/t, t], t = this
    rejection_threshold: float = 1.001
    ratio_norm: str = "none"        # "guard": GRPO-Guard's normalized ratio (flowgrpo.window_step_terms)
    off_policy: bool = False        # batches may come from the previous policy (rollout.overlap): see `__call__`
    drop_zero_advantage: bool = False  # skip micro-batches whose advantages are all 0 (see `accumulate_gradients`)
    shuffle_seed: int = 0           # the rows' shuffle between inner epochs; with "nft" also its timesteps and noise
    # "nft": DiffusionNFT (jaxflow.algorithms.nft) on the rollout's final latents, nft_timesteps noised timesteps a sample, the
    # old policy (TrainState.old, what the rollout serves) moved after each step by nft.old_decay(*nft_decay)
    algorithm: str = "flowgrpo"
    nft_beta: float = 0.1
    nft_timesteps: int = 1
    nft_decay: tuple[float, float, float] = (75, 0.0075, 0.999)

    def __post_init__(self):
        object.__setattr__(self, "grid_hw", tuple(int(s) for s in self.grid_hw))
        object.__setattr__(self, "nft_decay", tuple(float(x) for x in self.nft_decay))
        object.__setattr__(self, "cfg_interval", tuple(float(x) for x in self.cfg_interval))
        bad = next(((name, why) for name, fails, why in self._rules() if fails), None)
        if bad:
            raise ValueError(f"TrainConfig.{bad[0]}={getattr(self, bad[0])!r}; {bad[1]}")

    def _rules(self):
        """(field, fails, why) for every rule on the fields, in the order they are checked: the one place they are
        written (jaxflow.config.validate reports the first failing one under its config key)."""
        nft = self.algorithm == "nft"
        flat, rate, cap = self.nft_decay
        return (
            ("algorithm", self.algorithm not in ALGORITHMS, f"choose one of {ALGORITHMS}"),
            ("guidance", self.guidance < 1, "must be >= 1 (1: no CFG)"),
            ("guidance", nft and self.guidance != 1, "NFT trains and samples a CFG-free policy: 1"),
            ("cfg_interval", not (len(self.cfg_interval) == 2 and 0 <= self.cfg_interval[0] <= self.cfg_interval[1]
                                  <= 1), "(lo, hi) with 0 <= lo <= hi <= 1"),
            ("cfg_renorm_min", not 0 <= self.cfg_renorm_min <= 1, "must be in [0, 1]"),
            ("sde_type", not nft and self.sde_type not in ("sde", "cps"),
             "training needs 'sde' or 'cps' ('ode' has no log-prob to train; it samples for algorithm 'nft')"),
            ("sde_type", nft and self.sde_type not in ("sde", "cps", "ode"),
             "choose 'ode' (DiffusionNFT's deterministic rollout), 'sde' or 'cps'"),
            ("clip_range", not self.clip_range > 0, "must be > 0"),
            ("beta", not self.beta >= 0, "must be >= 0 (0: no KL term)"),
            ("learning_rate", not self.learning_rate > 0, "must be > 0"),
            ("num_micro_batches", self.num_micro_batches < 1, "must be >= 1"),
            ("num_mini_batches", self.num_mini_batches < 1, "must be >= 1"),
            ("num_inner_epochs", self.num_inner_epochs < 1, "must be >= 1"),
            ("old_log_prob", self.old_log_prob not in OLD_LOG_PROBS,
             "choose 'rollout' (the engine's log-probs), 'recompute' (the trainer's, before the first update) or "
             "'rollout_corrected' (the engine's, rejecting samples beyond rejection_threshold)"),
            ("old_log_prob", nft and self.old_log_prob == "rollout_corrected",
             "corrects log-probs; NFT has none: 'rollout'"),
            ("ratio_norm", self.ratio_norm not in RATIO_NORMS,
             "choose 'none' (FlowGRPO's ratio) or 'guard' (GRPO-Guard's)"),
            ("ratio_norm", nft and self.ratio_norm != "none", "is a FlowGRPO ratio; NFT has none: 'none'"),
            ("ratio_norm", self.ratio_norm == "guard" and self.old_log_prob != "recompute",
             f"'guard' needs old_log_prob='recompute' (got {self.old_log_prob!r}): the old policy's SDE means come "
             f"from the trainer's pass"),
            ("rejection_threshold", not self.rejection_threshold > 1,
             "must be > 1 (samples whose exp(logp - logp_rollout) leaves [1/t, t] are rejected)"),
            ("drop_zero_advantage", nft and self.drop_zero_advantage, "a zero advantage still trains in NFT "
                                                                      "(r = 1/2): False"),
            ("adam_b1", not 0 <= self.adam_b1 < 1, "must be in [0, 1)"),
            ("adam_b2", not 0 <= self.adam_b2 < 1, "must be in [0, 1): adam_b2 < 1"),
            ("adam_eps", not self.adam_eps > 0, "must be > 0"),
            ("ema_decay", self.ema_decay is not None and not 0 < self.ema_decay < 1, "must be in (0, 1), or None"),
            ("nft_beta", nft and not self.nft_beta > 0, "must be > 0"),
            ("nft_timesteps", nft and self.nft_timesteps < 1, "must be >= 1"),
            ("nft_decay", nft and not (flat >= 0 and rate >= 0 and 0 <= cap < 1),
             "(flat updates, rate, cap): flat >= 0, rate >= 0, cap in [0, 1)"))

    @property
    def nft(self) -> bool:
        """DiffusionNFT (`jaxflow.algorithms.nft`) rather than FlowGRPO."""
        return self.algorithm == "nft"

    @property
    def batch_fields(self) -> tuple[str, ...]:
        """The per-sample fields the step reads."""
        if self.nft:
            return NFT_FIELDS
        return BATCH_FIELDS + (GUIDANCE_FIELDS if self.guided else ())

    @property
    def guided(self) -> bool:
        """True classifier-free guidance is on: batches carry the negative prompt (GUIDANCE_FIELDS)."""
        return self.guidance > 1

    @property
    def updates(self) -> int:
        return self.num_inner_epochs * self.num_mini_batches

    @property
    def pass_skips_first(self) -> bool:
        """Whether the recompute pass leaves out mini-batch 0 (one inner epoch, on-policy: its update is the first
        and its own logp is logp_old)."""
        return self.num_inner_epochs == 1 and not self.off_policy

    @property
    def recompute_pass(self) -> bool:
        """Whether `step` runs the forward-only old-log-prob pass before its updates."""
        return not self.nft and self.old_log_prob == "recompute" and (self.updates > 1 or self.off_policy)

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
