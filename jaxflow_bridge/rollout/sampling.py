"""The FlowGRPO sampling loop shared by both rollout pipelines: true-CFG denoising with the SDE.

`SamplingLoop.generate(prompts, n, sampling, seeds)` returns a `TrajectoryBatch` (docs/numerics.md §9) for
B = len(prompts) * n samples, prompt-major (sample b belongs to prompt b // n, its group_id):

- one text-encoder pass over the distinct prompts and the negative prompt (template, drop 34 tokens);
- per denoising step one transformer forward over B samples; with true CFG (cfg > 1) either one forward over 2B
  with positive and negative text right-padded to one length (`cfg_forward="batched"`), or two forwards of B, each
  text at its own length (`"split"`: no padding between them, so no attention mask when the call's prompts have
  equal lengths), combined with per-token norm rescale;
- sigma reaches the timestep embedding in float32 (`Fp32Timestep`), latents stay float32 between steps;
- the returned text right-padded to `SamplingParams.text_tokens` (the train step's one text shape), if given;
- initial and step noise come from one CPU `torch.Generator` per sample seeded by that sample's seed, drawn
  every step for every sample, so a sample does not depend on its batch; with `same_latent` every sample of a
  group starts from its group's first sample's initial noise (step noise stays per sample);
- the schedule, SDE windows and the SDE/CPS/ODE step are `jaxflow_bridge.rollout.sde`; `solver` 'dpm2' takes
  second-order ODE steps instead (`jaxflow_bridge.rollout.solver`): every step with sde_type 'ode' (DiffusionNFT),
  the steps after each sample's SDE window otherwise (MixGRPO-Flash).
Never imports JAX.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch

from jaxflow_bridge.contract import sampling_rules
from jaxflow_bridge.contract.schedule import (CFG_FORWARDS, sample_windows, sigma_schedule, window_noise_levels,
                                              window_size)
from jaxflow_bridge.contract.trajectory import TrajectoryBatch
from jaxflow_bridge.rollout.solver import Solver
from jaxflow_bridge.rollout.tensors import torch_to_numpy

DECODE_PIXELS = 4 * 512 * 512  # pixels per VAE decode call: 4 samples at 512^2 (bounded memory), 128 at 64x128


def params_from_dict(cls, d: dict | None, what: str, tuple_fields: tuple[str, ...] = ()):
    """A frozen params dataclass `cls` from a plain dict (what crosses Ray): unknown keys are a ValueError naming
    them (never ignored), and so are missing keys without a default; `tuple_fields` come back as tuples (a list after
    JSON or msgpack)."""
    d = dict(d or {})
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; known: {known}")
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in d and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{what} {missing} have no default: give them")
    return cls(**{k: tuple(v) if k in tuple_fields and v is not None else v for k, v in d.items()})


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request knobs; names follow vllm-omni / verl-omni. Defaults: flow_grpo's recipe (the real one), but
    `true_cfg_scale`, which every request gives."""

    height: int = 512
    width: int = 512
    num_inference_steps: int = 10
    # true CFG (a second, negative pass) iff > 1; the config's sample.guidance (its default: the recipe's), no default
    true_cfg_scale: float = dataclasses.field(kw_only=True)
    negative_prompt: str = " "
    max_sequence_length: int = 512  # prompt tokens after the template drop; longer prompts are refused
    sde_type: str = "sde"  # 'sde' | 'cps' | 'ode'
    solver: str = "euler"  # 'euler' (the sde_type step) | 'dpm2' (DPM-Solver++(2M); after the window unless 'ode')
    noise_level: float = 1.2
    sde_window_size: int | None = 2  # None or 0: every step but the last
    sde_window_range: tuple[int, int] = (0, 5)
    seed: int = 0  # base seed when generate() gets no per-sample seeds
    # flow_grpo's same_latent: a group's samples start from its first sample's initial noise. That noise is no
    # action the policy trains on; sharing it removes reward variance the advantages cannot credit to the
    # trained steps (a state-dependent baseline)
    same_latent: bool = False
    keep_final: bool = False  # the trajectories carry the final latents (DiffusionNFT trains on them)
    # (prompt, negative prompt) tokens the returned trajectory's text is padded to after sampling (the train step's
    # one text shape, `TrajectoryBatch.padded`); None: the request's longest. The forwards run on the request's text
    text_tokens: tuple[int, int] | None = None

    @classmethod
    def from_dict(cls, d: dict | None) -> SamplingParams:
        """From a plain dict (what crosses Ray); unknown keys are a ValueError, never ignored."""
        return params_from_dict(cls, d, "sampling parameters", ("sde_window_range", "text_tokens"))

    @property
    def guided(self) -> bool:
        """True classifier-free guidance (a negative-prompt pass) is on."""
        return self.true_cfg_scale > 1


class Fp32Timestep:
    """Make the transformer's timestep embedding see sigma in float32, without editing diffusers.

    `QwenImageTransformer2DModel.forward` casts `timestep` to the model dtype before `time_text_embed`, so a bf16
    model would embed a bf16-rounded sigma. A forward pre-hook on `time_text_embed` swaps that argument for the
    float32 sigma stashed by `with fp32_timestep(sigma): transformer(...)`; the sinusoid is then computed in
    float32 and cast to the model dtype before `timestep_embedder`, as diffusers does. A hook (not a wrapper
    module) keeps state_dict names unchanged. In float32 the result is bit-identical to stock diffusers; outside
    the context the hook does nothing.
    """

    def __init__(self, transformer: torch.nn.Module):
        if getattr(transformer.config, "zero_cond_t", False):
            raise ValueError("Fp32Timestep does not support zero_cond_t transformers")
        self.sigma: torch.Tensor | None = None
        transformer.time_text_embed.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        if self.sigma is None:
            return None
        timestep, *rest = args
        if timestep.shape != self.sigma.shape:
            raise RuntimeError(f"stashed sigma {tuple(self.sigma.shape)} != timestep {tuple(timestep.shape)}")
        return (self.sigma.to(timestep.device), *rest)

    @contextlib.contextmanager
    def __call__(self, sigma: torch.Tensor):
        self.sigma = sigma.to(torch.float32)
        try:
            yield
        finally:
            self.sigma = None


def check_prompts(prompts, n) -> None:
    """ValueError unless `prompts` is a non-empty list of str and `n` (samples per prompt) an int >= 1."""
    if not isinstance(prompts, (list, tuple)) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"prompts must be a non-empty list of str, got {prompts!r}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n (samples per prompt) must be an int >= 1, got {n!r}")


def per_sample_seeds(batch: int, seeds) -> np.ndarray:
    """(B,) int64 seeds: an int is a base seed (base + 0..B-1); a sequence gives one seed per sample."""
    if isinstance(seeds, (int, np.integer)) and not isinstance(seeds, bool):
        seeds = [int(seeds) + i for i in range(batch)]
    seeds = list(seeds)
    if len(seeds) != batch or not all(isinstance(s, (int, np.integer)) and 0 <= s < 2**63 for s in seeds):
        raise ValueError(f"seeds must be {batch} ints in [0, 2**63) (one per sample) or one base seed, "
                         f"got {seeds!r}")
    return np.asarray(seeds, np.int64)


def decode_batch(height: int, width: int) -> int:
    """Samples per VAE decode call: DECODE_PIXELS worth of images, at least one."""
    return max(1, DECODE_PIXELS // (height * width))


def cfg_combine(pos: torch.Tensor, neg: torch.Tensor, scale: float) -> torch.Tensor:
    """True CFG with norm rescale: comb = neg + scale (pos - neg), times |pos| / |comb| per token (norms over the
    last, channel dim). `pos` and `neg` are the float32 velocities of the positive and negative text."""
    comb = neg + scale * (pos - neg)
    return comb * (torch.linalg.vector_norm(pos, dim=-1, keepdim=True)
                   / torch.linalg.vector_norm(comb, dim=-1, keepdim=True))


def _pad_text(embeds: list[torch.Tensor], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad (L_i, D) embeds to (B, length, D) with zeros and a bool mask."""
    out = embeds[0].new_zeros(len(embeds), length, embeds[0].shape[-1])
    mask = torch.zeros(len(embeds), length, dtype=torch.bool, device=out.device)
    for i, e in enumerate(embeds):
        out[i, : len(e)] = e
        mask[i, : len(e)] = True
    return out, mask


def _right_pad(t: torch.Tensor, length: int) -> torch.Tensor:
    """Zero/False-pad dim 1 of (B, L, ...) on the right to `length`."""
    pad = torch.zeros(t.shape[0], length - t.shape[1], *t.shape[2:], dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=1)


class SamplingLoop:
    """Sampling with trajectories for a family whose text is encoder embeds (true CFG). Subclasses provide the
    components and their settings: tokenizer,
    text_encoder, vae, transformer, template, drop, vae_scale_factor, scheduler_config, device, dtype,
    fp32_timestep (an `Fp32Timestep` on the transformer) and policy_version; `cfg_forward` (one of CFG_FORWARDS)
    may be set per instance (the first by default, as the recipe's rollout.cfg_forward)."""

    cfg_forward = CFG_FORWARDS[0]

    @property
    def size_multiple(self) -> int:
        """Height and width must be multiples of this: 2 x the VAE factor (16 for the released VAE)."""
        return 2 * self.vae_scale_factor

    # ------------------------------------------------------------------------------------------ validation

    def validate(self, prompts, n: int, sampling: SamplingParams, seeds=None) -> np.ndarray:
        """ValueError on any bad input, before a model runs; returns the per-sample seeds (B,) int64."""
        check_prompts(prompts, n)
        sampling_rules.check(sampling, self.size_multiple, f"2 x VAE factor {self.vae_scale_factor}")
        texts = list(prompts) + ([sampling.negative_prompt] if sampling.guided else [])
        self._check_lengths(texts, sampling.max_sequence_length)
        return per_sample_seeds(len(prompts) * n, sampling.seed if seeds is None else seeds)

    def _check_lengths(self, texts: list[str], limit: int) -> None:
        ids = self.tokenizer([self.template.format(t) for t in texts])["input_ids"]
        long = [(i, len(x) - self.drop) for i, x in enumerate(ids) if len(x) - self.drop > limit]
        if long:
            listed = ", ".join(f"#{i} ({k} tokens: {texts[i][:40]!r})" for i, k in long[:5])
            raise ValueError(f"{len(long)} prompt(s) exceed max_sequence_length={limit} tokens after the "
                             f"template (no truncation): {listed}")

    # ------------------------------------------------------------------------------------------ model pieces

    @torch.inference_mode()
    def encode(self, texts: list[str]) -> list[torch.Tensor]:
        """One text-encoder pass: per text the (L_i, D) last hidden states of its valid tokens, template dropped."""
        tok = self.tokenizer([self.template.format(t) for t in texts], padding=True, return_tensors="pt")
        ids, mask = tok.input_ids.to(self.device), tok.attention_mask.to(self.device)
        hidden = self.text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
        return [h[m.bool()][self.drop:].to(self.dtype) for h, m in zip(hidden, mask)]

    @torch.inference_mode()
    def velocity(self, latents, sigma, prompt_embeds, prompt_mask, negative_embeds=None, negative_mask=None, *,
                 true_cfg_scale: float = 1.0, grid: tuple[int, int], references=None) -> torch.Tensor:
        """float32 v for (B, S, C) latents at sigma (scalar or (B,)): one forward over B; with true CFG one over 2B
        or two over B (`cfg_forward`).

        Text: (B, L, D) embeds with (B, L) bool masks, right-padded. grid: the packed (rows, cols), rows * cols = S.
        references: an edit model's (B, R, S, C) reference latents, or None. With negatives and true_cfg_scale > 1:
        `cfg_combine` of the two (in float32).
        """
        x = latents.to(self.device, torch.float32)
        batch = x.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32).reshape(-1).expand(batch)
        if negative_embeds is None or true_cfg_scale <= 1:
            return self._forward(x, sigma, prompt_embeds, prompt_mask, grid, references)
        if self.cfg_forward == "split":
            pos = self._forward(x, sigma, prompt_embeds, prompt_mask, grid, references)
            neg = self._forward(x, sigma, negative_embeds, negative_mask, grid, references)
        else:
            length = max(prompt_embeds.shape[1], negative_embeds.shape[1])
            text = torch.cat([_right_pad(prompt_embeds, length), _right_pad(negative_embeds, length)])
            mask = torch.cat([_right_pad(prompt_mask, length), _right_pad(negative_mask, length)])
            refs = None if references is None else torch.cat([references, references])
            pos, neg = self._forward(torch.cat([x, x]), sigma.repeat(2), text, mask, grid, refs).split(batch)
        return cfg_combine(pos, neg, true_cfg_scale)

    def _forward(self, x, sigma, text, mask, grid, references=None) -> torch.Tensor:
        """One transformer call: float32 (N, S, C) latents, float32 (N,) sigma, (N, L, D) text, (N, L) mask; with
        (N, R, S, C) `references`, their tokens after the latents' (each image its own entry of img_shapes, as the
        edit pipelines pass them) and the latents' rows of the output."""
        shapes = [(1, *grid)] * (1 + (0 if references is None else references.shape[1]))
        if references is not None:
            x = torch.cat([x, references.reshape(x.shape[0], -1, x.shape[-1]).to(x)], dim=1)
        with self.fp32_timestep(sigma):
            out = self.transformer(hidden_states=x.to(self.dtype), timestep=sigma.to(self.device),
                                   encoder_hidden_states=text.to(self.device, self.dtype),
                                   encoder_hidden_states_mask=mask.to(self.device),
                                   img_shapes=[shapes] * x.shape[0], return_dict=False)[0].float()
        return out[:, : grid[0] * grid[1]]

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> np.ndarray:
        """(B, S, C) packed latents -> (B, H, W, 3) uint8, `decode_batch(height, width)` samples a call: bounded
        memory at full size, and few calls for small images (each VAE call launches ~90 modules)."""
        f = self.vae_scale_factor
        h, w = height // (2 * f), width // (2 * f)
        z_dim = self.vae.config.z_dim
        stats = [torch.tensor(self.vae.config[k]).view(1, z_dim, 1, 1, 1).to(self.device, self.vae.dtype)
                 for k in ("latents_mean", "latents_std")]
        mean, inv_std = stats[0], 1.0 / stats[1]
        images = []
        for x in latents.split(decode_batch(height, width)):
            b = len(x)
            z = x.reshape(b, h, w, z_dim, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, z_dim, 1, 2 * h, 2 * w)
            z = z.to(self.device, self.vae.dtype) / inv_std + mean  # diffusers' order of operations
            image = self.vae.decode(z, return_dict=False)[0][:, :, 0].float()
            image = ((image * 0.5 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
            images.append(image.permute(0, 2, 3, 1).cpu().numpy())
        return np.concatenate(images)

    # ------------------------------------------------------------------------------------------ generation

    def conditioning(self, prompts: list[str], sp: SamplingParams, references=None):
        """(per prompt its (L_i, D) text embeds; the negative prompt's, one for all or one per prompt, or None without
        CFG; per prompt its (R, S, C) reference latents or None): what sampling is conditioned on, computed once per
        prompt, never per sample of its group. A text-to-image model takes no `references`."""
        if references is not None:
            raise ValueError("this model takes no reference images (references): it is not an edit model")
        embeds = self.encode(list(prompts) + ([sp.negative_prompt] if sp.guided else []))
        return embeds[: len(prompts)], (embeds[len(prompts):] or None), None

    @torch.inference_mode()
    def generate(self, prompts: list[str], n: int, sampling: SamplingParams, seeds=None,
                 references=None) -> TrajectoryBatch:
        """B = len(prompts) * n trajectories; seeds: one per sample, a base seed, or None (sampling.seed);
        references: an edit model's reference images, one uint8 (R, H, W, 3) array per prompt (its group's)."""
        sp = sampling
        seeds = self.validate(prompts, n, sp, seeds)
        steps, size = sp.num_inference_steps, sp.sde_window_size
        grid = (sp.height // self.size_multiple, sp.width // self.size_multiple)
        sigmas = sigma_schedule(self.scheduler_config, steps, grid[0] * grid[1])
        starts = sample_windows(seeds, size, sp.sde_window_range, steps)

        embeds, negatives, refs = self.conditioning(list(prompts), sp, references)
        group = np.repeat(np.arange(len(prompts)), n)
        text = _pad_text([embeds[g] for g in group], max(len(e) for e in embeds))
        if sp.guided:
            rows = [negatives[g if len(negatives) > 1 else 0] for g in group]
            text += _pad_text(rows, max(len(e) for e in rows))
        refs = None if refs is None else refs[torch.from_numpy(group).to(refs.device)]  # a view per sample

        gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
        noise = torch.stack([torch.randn(grid[0] * grid[1], self.transformer.config.in_channels, generator=g)
                             for g in gens])
        if sp.same_latent:  # after every generator drew its own: each sample's step noise stays as it was
            noise = noise[torch.from_numpy(np.repeat(np.arange(len(prompts)) * n, n))]
        final, latents, log_probs = self._denoise(noise.to(self.device), sigmas, starts, gens, sp, text, grid, refs)
        neg = text[2:] or (None, None)
        return TrajectoryBatch.assembled(  # validated where it crosses into a process
            images=self.decode(final, sp.height, sp.width), latents=latents.cpu().numpy(),
            log_probs=log_probs.cpu().numpy(), sigmas=sigmas,
            step_index=(starts[:, None] + np.arange(window_size(size, steps))).astype(np.int32),
            prompt_embeds=torch_to_numpy(text[0]), prompt_mask=text[1].cpu().numpy(),
            negative_prompt_embeds=None if neg[0] is None else torch_to_numpy(neg[0]),
            negative_prompt_mask=None if neg[1] is None else neg[1].cpu().numpy(),
            prompts=[prompts[g] for g in group], group_ids=group.astype(np.int64), seeds=seeds,
            policy_versions=np.full(len(group), self.policy_version, np.int64),
            final_latents=final.float().cpu().numpy() if sp.keep_final else None,
            reference_latents=None if refs is None else refs.float().cpu().numpy()).padded(sp.text_tokens)

    def _denoise(self, x, sigmas, starts, gens, sp: SamplingParams, text, grid, refs=None):
        """Run every step from x; returns the final latents, the window latents (B, W+1, S, C) and log-probs (B, W)."""
        steps, size = sp.num_inference_steps, sp.sde_window_size
        levels = torch.from_numpy(window_noise_levels(starts, size, steps, sp.noise_level))
        batch, window = x.shape[0], window_size(size, steps)
        latents = x.new_zeros(batch, window + 1, *x.shape[1:])
        log_probs = x.new_zeros(batch, window)
        rows = torch.arange(batch, device=x.device)
        solver = Solver(sp.solver, sigmas, sp.sde_type, window_ends=starts + window)
        starts = torch.as_tensor(starts, dtype=torch.long, device=x.device)
        for i in range(steps):
            noise = torch.stack([torch.randn(x.shape[1:], generator=g) for g in gens]).to(x.device)
            slot = i - starts
            latents[slot == 0, 0] = x[slot == 0]
            v = self.velocity(x, sigmas[i], *text, true_cfg_scale=sp.true_cfg_scale, grid=grid, references=refs)
            x, log_prob = solver.step(x, v, i, noise_level=levels[:, i], noise=noise)
            inside = (slot >= 0) & (slot < window)
            latents[rows[inside], slot[inside] + 1] = x[inside]
            log_probs[rows[inside], slot[inside]] = log_prob[inside]
        return x, latents, log_probs
