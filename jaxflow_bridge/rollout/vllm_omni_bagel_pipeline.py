"""Our BAGEL rollout inside vLLM-Omni 0.20 (docs/bagel.md §7 (d)): the request codec and the pipeline class.

`FlowGRPOBagelPipeline` is vLLM-Omni's `BagelPipeline` (its loading, MoT transformer, prefill, CFG branches and
autoencoder) with our steps: a rollout request of n samples runs the stock `forward` once a sample, with the
sample's `WindowScheduler` (jaxflow_bridge/rollout/bagel_scheduler.py) as `self.scheduler`, the hook through which
`Bagel.generate_image` takes each step, and the sample's initial latents in place of the ones `prepare_vae_latent`
draws from the global RNG. The stock forward prefills `<|im_start|>` + prompt + `<|im_end|>` (our
`engine_bagel.context_ids`) and an empty context for the text CFG's unconditional branch; image CFG stays off
(`cfg_img_scale` 1). Think mode (`think` / `max_think_tokens` in extra_args, greedy: `do_sample` False) is the stock
forward's own: `prepare_start_tokens`, `generate_text` on a copy of the conditional cache, whose fed tokens advance its
length and RoPE position; we record what `generate_text` returns and append it to the sample's `prompt_ids` (each
sample decodes again, n times a prompt: as its prefills, a shared decode is a later speed-up). Requests without our
`extra_args` (warm-up, plain text-to-image) run the stock pipeline.
The engine's velocity sees its own float32 timesteps (`linspace(1, 0, N + 1)` shifted by 3), the steps our
contract's sigmas of the same formula: equal up to float32 rounding. Built lazily on attribute access, as
`vllm_omni_pipeline`'s classes are; never imports JAX. Not yet run on a GPU.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from jaxflow_bridge.contract.schedule import sigma_schedule
from jaxflow_bridge.contract.trajectory import TrajectoryBatch
from jaxflow_bridge.rollout.bagel_sampling import PIXELS_PER_TOKEN, SCHEDULER_CONFIG, BagelSamplingParams, pad_ids
from jaxflow_bridge.rollout.bagel_scheduler import WindowScheduler
from jaxflow_bridge.rollout.vllm_omni_pipeline import pack_trajectories

PIPELINE_CLASS = f"{__name__}.FlowGRPOBagelPipeline"
# BagelSamplingParams fields in OmniDiffusionSamplingParams attributes; the rest ride in extra_args
PARAM_FIELDS = ("height", "width")
# BAGEL's stock keys: image CFG off, global renorm, the empty negative, greedy think decodes
ENGINE_EXTRA = {"cfg_img_scale": 1.0, "cfg_renorm_type": "global", "negative_prompt": "", "do_sample": False}


def encode_request(prompt: str, sampling: BagelSamplingParams, seeds, policy_version: int) -> tuple[dict, dict]:
    """(prompt dict, OmniDiffusionSamplingParams kwargs) for n = len(seeds) samples of one prompt: the stock keys
    the BAGEL pipeline reads (num_inference_steps = N + 1 schedule points, cfg_text_scale, cfg_interval,
    cfg_renorm_min, think, max_think_tokens; image CFG off, empty negative, greedy) and our fields in extra_args."""
    fields = dataclasses.asdict(sampling)
    extra = {k: v for k, v in fields.items() if k not in PARAM_FIELDS}
    extra.update(ENGINE_EXTRA, cfg_interval=list(sampling.cfg_interval),
                 sde_window_range=list(sampling.sde_window_range), seeds=[int(s) for s in seeds],
                 policy_version=int(policy_version))
    kwargs = {**{k: fields[k] for k in PARAM_FIELDS}, "num_inference_steps": sampling.num_inference_steps + 1,
              "seed": int(seeds[0]), "num_outputs_per_prompt": len(seeds), "extra_args": extra}
    return {"prompt": prompt}, kwargs


def is_rollout_request(params) -> bool:
    """Whether OmniDiffusionSamplingParams came from `encode_request` (its extra_args carry per-sample seeds)."""
    return "seeds" in (getattr(params, "extra_args", None) or {})


def decode_request(prompts: list, params) -> tuple[str, BagelSamplingParams, list[int], int]:
    """(prompt, BagelSamplingParams, seeds, policy_version) back from a request's prompts and sampling params."""
    if len(prompts) != 1 or not isinstance(prompts[0], dict):
        raise ValueError(f"a rollout request carries one prompt dict, got {prompts!r}")
    extra = dict(params.extra_args)
    names = {f.name for f in dataclasses.fields(BagelSamplingParams)}
    values = {k: v for k, v in extra.items() if k in names}
    values.update({k: getattr(params, k) for k in PARAM_FIELDS}, cfg_interval=tuple(extra["cfg_interval"]),
                  sde_window_range=tuple(extra["sde_window_range"]))
    return prompts[0]["prompt"], BagelSamplingParams(**values), list(extra["seeds"]), int(extra["policy_version"])


def build_pipeline_class(base: type, output_cls) -> type:
    """Our pipeline as a subclass of `base` (vLLM-Omni's BagelPipeline: `forward(req)`, `self.bagel`,
    `self.tokenizer`, `self.scheduler` / `self.scheduler_kwargs`); `output_cls` builds its results (vLLM-Omni's
    DiffusionOutput). Parameters, so tests can run it on a stand-in."""
    from jaxflow_bridge.rollout.engine_bagel import context_ids

    def __init__(self, *, od_config, **kwargs):
        base.__init__(self, od_config=od_config, **kwargs)
        self.policy_version = 0

    def sample(self, req, sched: WindowScheduler, think: bool) -> tuple[np.ndarray, list[int]]:
        """One stock forward with `sched` taking every step from `sched.initial`: the image (H, W, 3) uint8 and the
        tokens its think decode fed (none without `think`)."""
        bagel, draw, decode, fed = self.bagel, self.bagel.prepare_vae_latent, self.bagel.generate_text, []

        def with_initial(*args, **kwargs):  # the sample's own initial latents, not the global RNG's
            out = draw(*args, **kwargs)
            if tuple(out["packed_init_noises"].shape) != tuple(sched.initial.shape):
                raise ValueError(f"the engine's latents {tuple(out['packed_init_noises'].shape)} are not the "
                                 f"request's {tuple(sched.initial.shape)}")
            out["packed_init_noises"] = sched.initial.to(out["packed_init_noises"].dtype)
            return out

        def recorded(*args, **kwargs):  # the fed tokens (seq, 1): start token and generated ones, end excluded
            tokens = decode(*args, **kwargs)
            fed.append([int(t) for t in tokens[:, 0].tolist()])
            return tokens

        bagel.prepare_vae_latent, bagel.generate_text = with_initial, recorded
        self.scheduler, self.scheduler_kwargs = sched, {}
        try:
            image = base.forward(self, req).output
        finally:
            del bagel.prepare_vae_latent, bagel.generate_text
            self.scheduler = None
        if len(fed) != int(think):
            raise RuntimeError(f"the stock BAGEL forward ran {len(fed)} think decodes for think={think}")
        return np.asarray(image, np.uint8), fed[0] if fed else []

    def forward(self, req, *args, **kwargs):
        """A rollout request -> DiffusionOutput with our trajectory; any other request -> the stock pipeline."""
        if not is_rollout_request(req.sampling_params):
            return base.forward(self, req, *args, **kwargs)
        prompt, sp, seeds, self.policy_version = decode_request(req.prompts, req.sampling_params)
        grid = (sp.height // PIXELS_PER_TOKEN, sp.width // PIXELS_PER_TOKEN)
        sigmas = sigma_schedule(SCHEDULER_CONFIG, sp.num_inference_steps, grid[0] * grid[1])
        scheds = [WindowScheduler(sigmas, s, window=sp.sde_window_size, window_range=sp.sde_window_range,
                                  noise_level=sp.noise_level, sde_type=sp.sde_type, tokens=grid[0] * grid[1],
                                  channels=self.bagel.latent_channel * self.bagel.latent_patch_size ** 2)
                  for s in seeds]
        if sp.same_latent:  # each drew its own first, as BagelSamplingLoop's generators do
            for sched in scheds[1:]:
                sched.initial = scheds[0].initial
        images, fed = zip(*(self.sample(req, sched, sp.think) for sched in scheds))
        paths = [sched.trajectory() for sched in scheds]
        ids, mask = pad_ids([context_ids(self.tokenizer, prompt) + f for f in fed])
        n = len(seeds)
        empty = dict(negative_prompt_ids=np.zeros((n, 0), np.int32),
                     negative_prompt_mask=np.zeros((n, 0), bool)) if sp.cfg_text_scale > 1 else {}
        images = np.stack(images)
        batch = TrajectoryBatch(
            images=images, latents=np.stack([p["latents"] for p in paths]),
            log_probs=np.stack([p["log_probs"] for p in paths]), sigmas=sigmas,
            step_index=np.stack([p["step_index"] for p in paths]),
            prompt_ids=ids.numpy().astype(np.int32), prompt_mask=mask.numpy(), **empty, prompts=[prompt] * n,
            group_ids=np.zeros(n, np.int64), seeds=np.asarray(seeds, np.int64),
            policy_versions=np.full(n, self.policy_version, np.int64),
            final_latents=np.stack([p["final"] for p in paths]) if sp.keep_final else None)
        # BAGEL's post-processing is the identity: the uint8 images as they are, not pack_trajectories' float copy
        return output_cls(**{**pack_trajectories(batch), "output": torch.from_numpy(images)})

    doc = "vLLM-Omni's BagelPipeline taking our SDE steps (see the module docstring)."
    namespace = {"__init__": __init__, "sample": sample, "forward": forward, "lora_component": "bagel",
                 "__module__": __name__, "__qualname__": "FlowGRPOBagelPipeline", "__doc__": doc}
    return type("FlowGRPOBagelPipeline", (base,), namespace)


def _pipeline_class() -> type:
    from vllm_omni.diffusion.data import DiffusionOutput
    from vllm_omni.diffusion.models.bagel.pipeline_bagel import BagelPipeline

    return build_pipeline_class(BagelPipeline, DiffusionOutput)


def __getattr__(name: str):
    """Build (once) the class that needs vLLM-Omni, when vLLM-Omni's loader asks for it by name."""
    if name != "FlowGRPOBagelPipeline":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = _pipeline_class()
    return value
