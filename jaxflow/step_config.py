"""The train step's static configuration (`TrainConfig`, flow_grpo's defaults; docs/numerics.md §4, §10), its state
(`TrainState`), and the per-sample fields each algorithm reads. The step itself is `jaxflow.train_step`."""
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
OLD_LOG_PROBS = ("rollout", "recompute", "rollout_corrected")
RATIO_NORMS = ("none", "guard")
ALGORITHMS = ("flowgrpo", "nft")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Static configuration of the step (flow_grpo defaults, `config/base.py`; docs/numerics.md §4)."""

    grid_hw: tuple[int, int]
    sde_type: str = "sde"
    guidance: float = 1.0          # > 1: true CFG in the training forward
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
    # "nft": DiffusionNFT (jaxflow.nft) on the rollout's final latents, nft_timesteps noised timesteps a sample, the
    # old policy (TrainState.old, what the rollout serves) moved after each step by nft.old_decay(*nft_decay)
    algorithm: str = "flowgrpo"
    nft_beta: float = 0.1
    nft_timesteps: int = 1
    nft_decay: tuple[float, float, float] = (75, 0.0075, 0.999)

    def __post_init__(self):
        object.__setattr__(self, "grid_hw", tuple(int(s) for s in self.grid_hw))
        object.__setattr__(self, "nft_decay", tuple(float(x) for x in self.nft_decay))
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        if self.nft:
            self._check_nft()
        elif self.sde_type not in ("sde", "cps"):
            raise ValueError(f"sde_type must be 'sde' or 'cps' ('ode' has no log-prob to train), got {self.sde_type!r}")
        if self.guidance < 1 or self.clip_range <= 0 or self.beta < 0 or min(
                self.num_micro_batches, self.num_mini_batches, self.num_inner_epochs) < 1:
            raise ValueError(f"need guidance >= 1, clip_range > 0, beta >= 0 and num_micro_batches, "
                             f"num_mini_batches, num_inner_epochs >= 1: {self}")
        if self.old_log_prob not in OLD_LOG_PROBS:
            raise ValueError(f"old_log_prob must be one of {OLD_LOG_PROBS}, got {self.old_log_prob!r}")
        if self.ratio_norm not in RATIO_NORMS:
            raise ValueError(f"ratio_norm must be one of {RATIO_NORMS}, got {self.ratio_norm!r}")
        if self.ratio_norm == "guard" and self.old_log_prob != "recompute":
            raise ValueError("ratio_norm='guard' needs old_log_prob='recompute' (the old policy's SDE means come "
                             "from the trainer's pass; the engine returns none)")
        if not self.rejection_threshold > 1:
            raise ValueError(f"rejection_threshold must be > 1, got {self.rejection_threshold}")
        if not (0 <= self.adam_b1 < 1 and 0 <= self.adam_b2 < 1 and self.adam_eps > 0):
            raise ValueError(f"need 0 <= adam_b1, adam_b2 < 1 and adam_eps > 0, got {self.adam_b1}, {self.adam_b2}, "
                             f"{self.adam_eps}")
        if self.ema_decay is not None and not 0 < self.ema_decay < 1:
            raise ValueError(f"ema_decay must be in (0, 1) or None, got {self.ema_decay}")

    def _check_nft(self):
        bad = [why for why, fails in (
            (f"guidance {self.guidance} (NFT trains a CFG-free policy: 1)", self.guidance != 1),
            (f"ratio_norm {self.ratio_norm!r} (a FlowGRPO ratio: 'none')", self.ratio_norm != "none"),
            (f"old_log_prob {self.old_log_prob!r} (NFT has no log-probs to correct)",
             self.old_log_prob == "rollout_corrected"),
            ("drop_zero_advantage (a zero advantage still trains in NFT: r = 1/2)", self.drop_zero_advantage),
            (f"nft_beta {self.nft_beta} (must be > 0)", not self.nft_beta > 0),
            (f"nft_timesteps {self.nft_timesteps} (must be >= 1)", self.nft_timesteps < 1),
            (f"nft_decay {self.nft_decay} (flat >= 0, rate >= 0, cap in [0, 1))",
             not (self.nft_decay[0] >= 0 and self.nft_decay[1] >= 0 and 0 <= self.nft_decay[2] < 1))) if fails]
        if bad:
            raise ValueError(f"algorithm 'nft' does not take {'; '.join(bad)}")

    @property
    def nft(self) -> bool:
        """DiffusionNFT (`jaxflow.nft`) rather than FlowGRPO."""
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
