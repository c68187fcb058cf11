"""The FlowGRPO sampling loop for BAGEL text-to-image (docs/bagel.md §2), over any model with BagelTorch's
interface: `prefill(ids, mask) -> context`, `velocity(x, sigma, context, grid_hw) -> v`, `latent_dim`.

`BagelSamplingLoop.generate(prompt_ids, n, sampling, seeds)` runs B = len(prompt_ids) * n samples in lockstep,
prompt-major (sample b belongs to prompt b // n), into a `TrajectoryBatch` carrying the context's token ids:

- contexts: each sample's conditional context (its prompt's ids, framing tokens included) prefilled once, or in
  think mode its prompt's context extended by the prompt's think tokens (one greedy decode a prompt); the
  unconditional context is empty (BAGEL's default negative prompt "": no tokens, image at RoPE position 0), carried
  as L' = 0 negative ids when CFG is on;
- schedule: the contract's sigmas with BAGEL's static shift 3 (`sigma_schedule`), N steps and N + 1 points
  (vLLM-Omni's `num_inference_steps` counts the points: N + 1);
- noise: initial and step noise from one CPU `torch.Generator` per sample seeded by its seed, drawn every step,
  so a sample does not depend on its batch; `same_latent`: a group starts from its first sample's initial noise;
- CFG as `Bagel._combine_cfg` with the image scale 1 (text-to-image): at steps with lo < sigma <= hi and a text
  scale > 1, v = v_u + s (v_c - v_u) times clamp(|v_c| / (|v| + 1e-8), renorm_min, 1), norms per sample over all
  its elements ("global" renorm taken per sample, not over the packed batch); otherwise v = v_c alone;
- steps: the torch SDE step (`rollout/sde.py`) inside each sample's window (`sample_windows`), ODE outside; the
  window's latents and log-probs are kept.
`latent_preview` stands in for the FLUX VAE decode until the CPU engine gets a VAE. Never imports JAX.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import torch

from jaxflow_bridge.contract import sampling_rules
from jaxflow_bridge.contract.schedule import sample_windows, sigma_schedule, window_noise_levels, window_size
from jaxflow_bridge.contract.trajectory import TrajectoryBatch
from jaxflow_bridge.families.bagel.model import stack_contexts
from jaxflow_bridge.rollout.sampling import params_from_dict, per_sample_seeds
from jaxflow_bridge.rollout.solver import Solver

# BagelGenParams.timestep_shift (hard-coded 3.0): a static shift, no resolution dependence.
SCHEDULER_CONFIG = {"shift": 3.0, "use_dynamic_shifting": False}
PIXELS_PER_TOKEN = 16  # a latent token is a 2 x 2 patch of the 8x-downsampling VAE
RENORM_EPS = 1e-8  # Bagel._combine_cfg's denominator guard


@dataclasses.dataclass(frozen=True)
class BagelSamplingParams:
    """Per-request knobs. Defaults: verl-omni's BAGEL OCR recipe (image CFG 1, interval (0, 1), global
    renorm, min 0; 'sde' noise 0.7, window 2 in [0, 7))."""

    height: int = 512
    width: int = 512
    num_inference_steps: int = 14  # N denoising steps: N + 1 schedule points
    cfg_text_scale: float = dataclasses.field(kw_only=True)  # CFG iff > 1; the config's sample.guidance, no default
    cfg_interval: tuple[float, float] = (0.0, 1.0)  # CFG at steps with lo < sigma <= hi
    cfg_renorm_min: float = 0.0
    sde_type: str = "sde"  # 'sde' | 'cps' | 'ode'
    solver: str = "euler"  # 'euler' (the sde_type step) | 'dpm2' (SamplingParams.solver)
    noise_level: float = 0.7
    sde_window_size: int | None = 2  # None or 0: every step but the last
    sde_window_range: tuple[int, int] = (0, 7)
    seed: int = 0  # base seed when generate() gets no per-sample seeds
    same_latent: bool = False
    keep_final: bool = False
    think: bool = False  # BAGEL's think mode: a greedy text decode extends the conditional context (think.py)
    max_think_tokens: int = 1000  # most tokens a think decode feeds, its start token included (vLLM-Omni's default)
    text_tokens: tuple[int, int] | None = None  # the returned context ids' padding (SamplingParams.text_tokens)

    @classmethod
    def from_dict(cls, d: dict | None) -> BagelSamplingParams:
        """From a plain dict; unknown keys are a ValueError, never ignored."""
        return params_from_dict(cls, d, "BAGEL sampling parameters",
                                ("cfg_interval", "sde_window_range", "text_tokens"))


def guided_velocity(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float, renorm_min: float) -> torch.Tensor:
    """BAGEL's text CFG with "global" renorm, per sample: v = v_u + scale (v_c - v_u), times
    clamp(|v_c| / (|v| + 1e-8), renorm_min, 1), norms over all of a sample's elements."""
    v = v_uncond + scale * (v_cond - v_uncond)
    norm = lambda t: torch.linalg.vector_norm(t.flatten(1), dim=1)  # noqa: E731
    factor = (norm(v_cond) / (norm(v) + RENORM_EPS)).clamp(renorm_min, 1.0)
    return v * factor.reshape(-1, *(1,) * (v.dim() - 1))


def latent_preview(latents: torch.Tensor, grid_hw: tuple[int, int], patch: int = 2) -> np.ndarray:
    """A stand-in for the VAE decode, not an image model: (B, h*w, patch^2 z) tokens in BAGEL's (p, q, c) order
    unpatchified to the (2h, 2w) latent image, its first three channels squashed by tanh to [0, 255] uint8 and
    repeated to (16h, 16w) pixels."""
    gh, gw = grid_hw
    b, _, c = latents.shape
    z = latents.float().reshape(b, gh, gw, patch, patch, c // patch**2).permute(0, 1, 3, 2, 4, 5)
    rgb = z.reshape(b, gh * patch, gw * patch, -1)[..., :3]
    up = PIXELS_PER_TOKEN // patch
    rgb = rgb.repeat_interleave(up, dim=1).repeat_interleave(up, dim=2)
    return ((torch.tanh(rgb) * 0.5 + 0.5) * 255).round().to(torch.uint8).cpu().numpy()


def validate(prompt_ids, n, sp: BagelSamplingParams, seeds, prompts=None) -> np.ndarray:
    """ValueError on bad input before any model runs; returns the per-sample seeds (B,) int64."""
    if (not isinstance(prompt_ids, (list, tuple)) or not prompt_ids
            or not all(len(p) and all(isinstance(t, (int, np.integer)) and t >= 0 for t in p) for p in prompt_ids)):
        raise ValueError("prompt_ids must be a non-empty list of non-empty token id lists (ints >= 0), "
                         "framing tokens included")
    if prompts is not None and len(prompts) != len(prompt_ids):
        raise ValueError(f"prompts must give one text per prompt_ids entry ({len(prompt_ids)}), got {len(prompts)}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n (samples per prompt) must be an int >= 1, got {n!r}")
    sampling_rules.check(sp, PIXELS_PER_TOKEN)
    if not isinstance(sp.keep_final, bool):
        raise ValueError(f"keep_final must be a bool, got {sp.keep_final!r}")
    if not isinstance(sp.think, bool) or isinstance(sp.max_think_tokens, bool) or not isinstance(
            sp.max_think_tokens, (int, np.integer)) or sp.max_think_tokens < 1:
        raise ValueError(f"think must be a bool and max_think_tokens an int >= 1, got {sp.think!r}, "
                         f"{sp.max_think_tokens!r}")
    lo, hi = sp.cfg_interval
    if sp.cfg_text_scale < 1 or not 0 <= lo <= hi <= 1 or not 0 <= sp.cfg_renorm_min <= 1:
        raise ValueError(f"cfg_text_scale must be >= 1 (1 turns CFG off), cfg_interval 0 <= lo <= hi <= 1 and "
                         f"cfg_renorm_min in [0, 1], got {sp.cfg_text_scale}, {sp.cfg_interval}, "
                         f"{sp.cfg_renorm_min}")
    return per_sample_seeds(len(prompt_ids) * n, sp.seed if seeds is None else seeds)


def pad_ids(ids: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token id lists to (B, L) int64 ids (0-padded) and a (B, L) bool mask."""
    length = max(len(x) for x in ids)
    out, mask = torch.zeros(len(ids), length, dtype=torch.long), torch.zeros(len(ids), length, dtype=torch.bool)
    for i, x in enumerate(ids):
        out[i, :len(x)], mask[i, :len(x)] = torch.tensor(list(x), dtype=torch.long), True
    return out, mask


class BagelSamplingLoop:
    """Sampling with trajectories over `model` (BagelTorch's interface); `decode(latents, grid_hw)` -> (B, H, W, 3)
    uint8 (default: the `latent_preview` stand-in); `policy_version` is stamped on every sample; `thinker(ids,
    max_tokens)` -> (think tokens, the one-row context they extend), `think.Thinker`: think mode's decode."""

    def __init__(self, model, decode: Callable[[torch.Tensor, tuple[int, int]], np.ndarray] = latent_preview,
                 policy_version: int = 0, thinker: Callable | None = None):
        self.model, self.decode, self.policy_version, self.thinker = model, decode, policy_version, thinker

    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[Sequence[int]], n: int, sampling: BagelSamplingParams, seeds=None,
                 prompts: Sequence[str] | None = None) -> TrajectoryBatch:
        """B = len(prompt_ids) * n trajectories; seeds: one per sample, a base seed, or None (sampling.seed);
        prompts: the prompts' text for `TrajectoryBatch.prompts` (default: empty strings)."""
        sp = sampling
        seeds = validate(prompt_ids, n, sp, seeds, prompts)
        if sp.think and self.thinker is None:
            raise ValueError("think mode needs a thinker (families.bagel.think.Thinker: the checkpoint's text head)")
        prompts = [""] * len(prompt_ids) if prompts is None else prompts
        steps, size = sp.num_inference_steps, sp.sde_window_size
        grid = (sp.height // PIXELS_PER_TOKEN, sp.width // PIXELS_PER_TOKEN)
        sigmas = sigma_schedule(SCHEDULER_CONFIG, steps, grid[0] * grid[1])
        starts = sample_windows(seeds, size, sp.sde_window_range, steps)

        group = np.repeat(np.arange(len(prompt_ids)), n)
        if sp.think:  # greedy: one decode a prompt, its context shared by the prompt's samples
            fed, thought = zip(*(self.thinker(p, sp.max_think_tokens) for p in prompt_ids))
            ids, mask = pad_ids([[*prompt_ids[g], *fed[g]] for g in group])
            cond = stack_contexts([thought[g] for g in group])
        else:
            ids, mask = pad_ids([prompt_ids[g] for g in group])
            cond = self.model.prefill(ids, mask)
        contexts = (cond, self.model.prefill(ids.new_zeros(len(group), 0), mask.new_zeros(len(group), 0)))
        gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
        x = torch.stack([torch.randn(grid[0] * grid[1], self.model.latent_dim, generator=g) for g in gens])
        if sp.same_latent:  # after every generator drew its own: each sample's step noise stays as it was
            x = x[torch.from_numpy(np.repeat(np.arange(len(prompt_ids)) * n, n))]
        final, latents, log_probs = self._denoise(x, sigmas, starts, gens, sp, contexts, grid)
        empty = dict(negative_prompt_ids=np.zeros((len(group), 0), np.int32),
                     negative_prompt_mask=np.zeros((len(group), 0), bool)) if sp.cfg_text_scale > 1 else {}
        return TrajectoryBatch.assembled(  # validated where it crosses into a process
            images=self.decode(final, grid), latents=latents.numpy(), log_probs=log_probs.numpy(), sigmas=sigmas,
            step_index=(starts[:, None] + np.arange(window_size(size, steps))).astype(np.int32),
            prompt_ids=ids.numpy().astype(np.int32), prompt_mask=mask.numpy(), **empty,
            prompts=[prompts[g] for g in group], group_ids=group.astype(np.int64), seeds=seeds,
            policy_versions=np.full(len(group), self.policy_version, np.int64),
            final_latents=final.numpy().copy() if sp.keep_final else None).padded(sp.text_tokens)

    def velocity(self, x, sigma: float, contexts, grid, sp: BagelSamplingParams) -> torch.Tensor:
        """The step's velocity at the float32 sigma: conditional, or CFG-guided inside the interval."""
        sig = torch.full((x.shape[0],), float(sigma), dtype=torch.float32)
        v_cond = self.model.velocity(x, sig, contexts[0], grid)
        lo, hi = sp.cfg_interval
        if sp.cfg_text_scale <= 1 or not lo < sigma <= hi:
            return v_cond
        v_uncond = self.model.velocity(x, sig, contexts[1], grid)
        return guided_velocity(v_cond, v_uncond, sp.cfg_text_scale, sp.cfg_renorm_min)

    def _denoise(self, x, sigmas, starts, gens, sp: BagelSamplingParams, contexts, grid):
        """Every step from x; returns the final latents, the window latents (B, W+1, S, C), log-probs (B, W)."""
        steps, size = sp.num_inference_steps, sp.sde_window_size
        levels = torch.from_numpy(window_noise_levels(starts, size, steps, sp.noise_level))
        batch, window = x.shape[0], window_size(size, steps)
        latents, log_probs = x.new_zeros(batch, window + 1, *x.shape[1:]), x.new_zeros(batch, window)
        rows, starts = torch.arange(batch), torch.from_numpy(starts).long()
        solver = Solver(sp.solver, sigmas, sp.sde_type, window_ends=starts.numpy() + window)
        for i in range(steps):
            noise = torch.stack([torch.randn(x.shape[1:], generator=g) for g in gens])
            slot = i - starts
            latents[slot == 0, 0] = x[slot == 0]
            v = self.velocity(x, sigmas[i], contexts, grid, sp)
            x, log_prob = solver.step(x, v, i, noise_level=levels[:, i], noise=noise)
            inside = (slot >= 0) & (slot < window)
            latents[rows[inside], slot[inside] + 1] = x[inside]
            log_probs[rows[inside], slot[inside]] = log_prob[inside]
        return x, latents, log_probs
