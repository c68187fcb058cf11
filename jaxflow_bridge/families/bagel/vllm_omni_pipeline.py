"""Our BAGEL rollout inside vLLM-Omni 0.20 (docs/bagel.md §2, §7 (d)): the request codec and the pipeline class.

`FlowGRPOBagelPipeline` is vLLM-Omni's `BagelPipeline` (its loading, MoT transformer, autoencoder) running a rollout
request's n samples in lockstep through vLLM-Omni's own pieces, one LLM forward a step for all n samples x 2 CFG
branches instead of the stock `forward` once a sample:

1. one prefill of the conditional context (`prepare_prompts` + `forward_cache_update_text` on a `NaiveCache`:
   `<|im_start|>` + prompt + `<|im_end|>`, our `families.bagel.engine.context_ids`) and, with `think` (greedy), one
   `prepare_start_tokens` + `generate_text` on it, shared by the request's samples; the unconditional context is
   empty (kv length 0, image at RoPE position 0); image CFG off;
2. one `Bagel.generate_image` over the n samples packed: the context cache repeated per sample, `prepare_vae_latent`
   / `prepare_vae_latent_cfg` with n image sizes, each sample's initial latents from its own `WindowScheduler`
   (jaxflow_bridge/families/bagel/scheduler.py; `same_latent` gives the group the first one's), `LockstepScheduler`
   as the `scheduler` hook (each sample's step by its own WindowScheduler: its generator, window and log-probs as
   alone) and `Bagel._combine_cfg` taken per sample for the call (the stock "global" renorm norms over the whole
   packed tensor, every sample's velocity at once);
3. the stock `_decode_image_from_latent` of each final latent (vLLM-Omni's uint8 truncation).
In the two-stage deployment (`bagel.yaml`: vLLM's AR thinker, then this DiT stage; docs/bagel.md §3) the request
arrives with the thinker's KV of the framed prompt (`past_key_values`, `kv_metadata`), which replaces step 1's
prefill after its length and next position are checked against that prefill's; think mode is single-stage only.
Everything runs under the stock forward's autocast. The trajectory's `prompt_ids` are the ids the prefill and the
think decode fed. The engine's velocity sees its own float32 timesteps (`linspace(1, 0, N + 1)` shifted by 3), the
steps our contract's sigmas of the same formula: equal up to float32 rounding. The engine's start-up warm-up
request gets an empty result (`jaxflow_bridge.engines.vllm_omni.codec.is_warmup_request`); other requests without
our `extra_args` (plain text-to-image) run the stock pipeline. Built lazily on attribute access, as
`vllm_omni.pipeline`'s classes are; never imports JAX. Parity on a GPU: BENCHMARKS.md, "BAGEL through vLLM-Omni, tiny".
"""
from __future__ import annotations

import dataclasses
import types

import numpy as np
import torch

from jaxflow_bridge.contract.schedule import sigma_schedule
from jaxflow_bridge.contract.trajectory import TrajectoryBatch
from jaxflow_bridge.families.bagel import spec
from jaxflow_bridge.families.bagel.sampling import PIXELS_PER_TOKEN, SCHEDULER_CONFIG, BagelSamplingParams, pad_ids
from jaxflow_bridge.families.bagel.scheduler import WindowScheduler
from jaxflow_bridge.engines.vllm_omni.bias_reload import load_with_biases_again
from jaxflow_bridge.engines.vllm_omni.codec import is_warmup_request, pack_trajectories
from jaxflow_bridge.engines.vllm_omni.startup import use_compile_threads

PIPELINE_CLASS = f"{__name__}.FlowGRPOBagelPipeline"
# BagelSamplingParams fields in OmniDiffusionSamplingParams attributes; the rest ride in extra_args
PARAM_FIELDS = ("height", "width")
# BAGEL's stock keys: image CFG off, global renorm, the empty negative, greedy think decodes
ENGINE_EXTRA = {"cfg_img_scale": 1.0, "cfg_renorm_type": "global", "negative_prompt": "", "do_sample": False}
# a two-stage request's prompt text: what vLLM's tokenizer turns into the framed ids `prepare_prompts` feeds
THINKER_FRAME = "<|im_start|>{}<|im_end|>"


def encode_request(prompt: str, sampling: BagelSamplingParams, seeds, policy_version: int,
                   framed: bool = False) -> tuple[dict, dict]:
    """(prompt dict, OmniDiffusionSamplingParams kwargs) for n = len(seeds) samples of one prompt: the stock keys
    the BAGEL pipeline reads (num_inference_steps = N + 1 schedule points, cfg_text_scale, cfg_interval,
    cfg_renorm_min, think, max_think_tokens; image CFG off, empty negative, greedy) and our fields in extra_args;
    text_tokens stays with the engine, which pads the trajectory it unpacks.
    `framed` (two stages): the prompt as the thinker prefills it, `<|im_start|>` + prompt + `<|im_end|>`, the ids our
    single-stage prefill feeds (`prepare_prompts`)."""
    fields = dataclasses.asdict(sampling)
    extra = {k: v for k, v in fields.items() if k not in (*PARAM_FIELDS, "text_tokens")}
    extra.update(ENGINE_EXTRA, cfg_interval=list(sampling.cfg_interval),
                 sde_window_range=list(sampling.sde_window_range), seeds=[int(s) for s in seeds],
                 policy_version=int(policy_version), framed=bool(framed))
    kwargs = {**{k: fields[k] for k in PARAM_FIELDS}, "num_inference_steps": sampling.num_inference_steps + 1,
              "seed": int(seeds[0]), "num_outputs_per_prompt": len(seeds), "extra_args": extra}
    return {"prompt": THINKER_FRAME.format(prompt) if framed else prompt}, kwargs


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
    prompt = prompts[0]["prompt"]
    if extra.get("framed"):
        head, tail = THINKER_FRAME.split("{}")
        prompt = prompt[len(head):len(prompt) - len(tail)]
    return prompt, BagelSamplingParams(**values), list(extra["seeds"]), int(extra["policy_version"])


class LockstepScheduler:
    """The `scheduler` hook for n samples packed in one `generate_image`: `step(v, t, x, dt)` splits the packed
    (n * S, C) velocity and latents into the samples' rows and steps each with its own `WindowScheduler`."""

    def __init__(self, samples: list[WindowScheduler]):
        self.samples, self.rows = samples, [s.initial.shape[0] for s in samples]

    def step(self, v: torch.Tensor, t, x: torch.Tensor, dt, **kwargs) -> types.SimpleNamespace:
        vs, xs = v.detach().float().cpu().split(self.rows), x.detach().float().cpu().split(self.rows)
        out = torch.cat([s.step(vi, t, xi, dt, **kwargs).prev_sample for s, vi, xi in zip(self.samples, vs, xs)])
        return types.SimpleNamespace(prev_sample=out.to(device=x.device, dtype=x.dtype), log_prob=None)


def per_sample_cfg(combine, rows: list[int]):
    """`combine` (`Bagel._combine_cfg`) over packed velocities, sample by sample (`rows` tokens each): a sample's
    "global" renorm takes its norms over its own elements, as when it runs alone."""

    def combined(v, v_text, v_img, *args, **kwargs):
        parts = zip(v.split(rows), v_text.split(rows), [None] * len(rows) if v_img is None else v_img.split(rows))
        return torch.cat([combine(*p, *args, **kwargs) for p in parts])

    return combined


def received_cache(kv, cache_cls):
    """The thinker's KV as vLLM-Omni hands it to the DiT stage (per layer `key_cache` / `value_cache` lists of packed
    (tokens, heads, dim) tensors) in a `cache_cls` (NaiveCache) of as many layers."""
    cache = cache_cls(len(kv.key_cache))
    for layer, (k, v) in enumerate(zip(kv.key_cache, kv.value_cache)):
        cache.key_cache[layer], cache.value_cache[layer] = k, v
    return cache


def repeat_cache(cache, n: int, cache_cls):
    """A `NaiveCache` (per layer packed K/V (tokens, heads, dim), None while empty) holding `cache`'s n times."""
    out = cache_cls(cache.num_layers)
    for layer in range(cache.num_layers):
        for src, dst in ((cache.key_cache, out.key_cache), (cache.value_cache, out.value_cache)):
            dst[layer] = None if src[layer] is None else torch.cat([src[layer]] * n)
    return out


def build_pipeline_class(base: type, output_cls, cache_cls) -> type:
    """Our pipeline as a subclass of `base` (vLLM-Omni's BagelPipeline: `forward(req)`, `self.bagel` (Bagel),
    `self.vae`, `self.tokenizer`, `self.new_token_ids`, `self.device`, `self.od_config.dtype`,
    `_decode_image_from_latent`); `output_cls` builds its results (DiffusionOutput), `cache_cls` its caches
    (NaiveCache). Parameters, so tests can run it on a stand-in."""

    def __init__(self, *, od_config, **kwargs):
        base.__init__(self, od_config=od_config, **kwargs)
        use_compile_threads(getattr(od_config, "custom_pipeline_args", None) or {})  # engines/vllm_omni/startup.py
        self.policy_version = 0

    def load_weights(self, weights):
        """vLLM-Omni's weight loading, then every bias again in a call of its own (vLLM 0.20's online FP8 loses a
        quantized linear's bias within the call: `jaxflow_bridge/engines/vllm_omni/bias_reload.py`)."""
        return load_with_biases_again(lambda w: base.load_weights(self, w), weights)

    def _autocast(self):  # the stock forward's
        return torch.autocast(device_type=self.device.type, enabled=self.device.type != "cpu",
                              dtype=self.od_config.dtype)

    def _on_device(self, inputs: dict) -> dict:
        return {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in inputs.items()}

    def _rollout_context(self, prompt: str, sp: BagelSamplingParams) -> tuple[dict, list[int]]:
        """The conditional context of one sequence ({past_key_values, kv_lens, ropes}, as the stock forward keeps
        it) and the ids it was fed: the framed prompt, then with `think` the greedy decode's fed tokens."""
        bagel = self.bagel
        inputs, kv_lens, ropes = bagel.prepare_prompts(curr_kvlens=[0], curr_rope=[0], prompts=[prompt],
                                                       tokenizer=self.tokenizer, new_token_ids=self.new_token_ids)
        fed = [int(t) for t in inputs["packed_text_ids"].tolist()]
        with self._autocast():
            cache = bagel.forward_cache_update_text(cache_cls(bagel.config.llm_config.num_hidden_layers),
                                                    **self._on_device(inputs))
            if sp.think:
                start = bagel.prepare_start_tokens(kv_lens, ropes, self.new_token_ids)
                tokens = bagel.generate_text(past_key_values=cache, max_length=sp.max_think_tokens, do_sample=False,
                                             end_token_id=self.new_token_ids["eos_token_id"], **self._on_device(start))
                thought = [int(t) for t in tokens[:, 0].tolist()]  # (seq, 1): fed tokens, the end token not fed
                fed += thought
                kv_lens, ropes = [k + len(thought) for k in kv_lens], [r + len(thought) for r in ropes]
        if cache.seq_lens != kv_lens[0]:
            raise RuntimeError(f"the BAGEL context cache holds {cache.seq_lens} tokens, {kv_lens[0]} were fed")
        return {"past_key_values": cache, "kv_lens": kv_lens, "ropes": ropes}, fed

    def _received_context(self, prompt: str, params) -> tuple[dict, list[int]]:
        """Two stages: the conditional context from the thinker's KV (`params.past_key_values`, its next RoPE
        position in `params.kv_metadata["ropes"]`) in place of our prefill; the ids are the framed prompt's, which
        the thinker prefilled (the engine checks them against the thinker's own). RuntimeError if the KV's length or
        position is not that prefill's."""
        bagel = self.bagel
        inputs, kv_lens, ropes = bagel.prepare_prompts(curr_kvlens=[0], curr_rope=[0], prompts=[prompt],
                                                       tokenizer=self.tokenizer, new_token_ids=self.new_token_ids)
        fed = [int(t) for t in inputs["packed_text_ids"].tolist()]
        cache = received_cache(params.past_key_values, cache_cls)
        sent = list((getattr(params, "kv_metadata", None) or {}).get("ropes") or [cache.seq_lens])
        if cache.seq_lens != kv_lens[0] or [int(r) for r in sent] != list(ropes):
            raise RuntimeError(f"the thinker sent {cache.seq_lens} context tokens at next position {sent}; the "
                               f"prompt's prefill feeds {kv_lens[0]} up to {ropes}")
        return {"past_key_values": cache, "kv_lens": kv_lens, "ropes": ropes}, fed

    def _rollout_denoise(self, context: dict, scheds: list[WindowScheduler], sp: BagelSamplingParams,
                         shape: tuple[int, int]) -> list[torch.Tensor]:
        """One `generate_image` over the n = len(scheds) samples packed: their final latents (S, C) each."""
        bagel, n = self.bagel, len(scheds)
        inputs = bagel.prepare_vae_latent(curr_kvlens=context["kv_lens"] * n, curr_rope=context["ropes"] * n,
                                          image_sizes=[shape] * n, new_token_ids=self.new_token_ids)
        drawn, initial = inputs["packed_init_noises"], torch.cat([s.initial for s in scheds])
        if drawn.shape != initial.shape:
            raise ValueError(f"the engine's latents {tuple(drawn.shape)} are not the request's {tuple(initial.shape)}")
        inputs["packed_init_noises"] = initial.to(drawn.dtype)  # the samples' own, not the global RNG's
        empty = self._on_device(bagel.prepare_vae_latent_cfg(curr_kvlens=[0] * n, curr_rope=[0] * n,
                                                             image_sizes=[shape] * n))
        bagel._combine_cfg = per_sample_cfg(type(bagel)._combine_cfg, [s.initial.shape[0] for s in scheds])
        try:
            with self._autocast():
                latents, *_ = bagel.generate_image(
                    past_key_values=repeat_cache(context["past_key_values"], n, cache_cls),
                    cfg_text_past_key_values=cache_cls(context["past_key_values"].num_layers),
                    num_timesteps=sp.num_inference_steps + 1, timestep_shift=SCHEDULER_CONFIG["shift"],
                    cfg_text_scale=sp.cfg_text_scale, cfg_img_scale=ENGINE_EXTRA["cfg_img_scale"],
                    cfg_interval=tuple(sp.cfg_interval), cfg_renorm_min=sp.cfg_renorm_min,
                    cfg_renorm_type=ENGINE_EXTRA["cfg_renorm_type"], **self._on_device(inputs),
                    cfg_text_packed_position_ids=empty["cfg_packed_position_ids"],
                    cfg_text_packed_query_indexes=empty["cfg_packed_query_indexes"],
                    cfg_text_key_values_lens=empty["cfg_key_values_lens"],
                    cfg_text_packed_key_value_indexes=empty["cfg_packed_key_value_indexes"],
                    return_trajectory_latents=False, scheduler=LockstepScheduler(scheds), scheduler_kwargs={})
        finally:
            del bagel._combine_cfg
        return list(latents)

    @torch.inference_mode()
    def forward(self, req, *args, **kwargs):
        """A rollout request -> DiffusionOutput with our trajectory; vLLM-Omni's start-up warm-up -> an empty one
        (`is_warmup_request`); any other request -> the stock pipeline."""
        if not is_rollout_request(req.sampling_params):
            return output_cls() if is_warmup_request(req) else base.forward(self, req, *args, **kwargs)
        prompt, sp, seeds, self.policy_version = decode_request(req.prompts, req.sampling_params)
        shape, n = (sp.height, sp.width), len(seeds)
        if max(shape) > self.bagel.max_latent_size * self.bagel.latent_downsample:
            raise ValueError(f"{sp.height}x{sp.width} exceeds this BAGEL's "
                             f"{self.bagel.max_latent_size * self.bagel.latent_downsample} pixels a side")
        grid = (sp.height // PIXELS_PER_TOKEN, sp.width // PIXELS_PER_TOKEN)
        sigmas = sigma_schedule(SCHEDULER_CONFIG, sp.num_inference_steps, grid[0] * grid[1])
        scheds = [WindowScheduler(sigmas, s, window=sp.sde_window_size, window_range=sp.sde_window_range,
                                  noise_level=sp.noise_level, sde_type=sp.sde_type, solver=sp.solver,
                                  tokens=grid[0] * grid[1],
                                  channels=self.bagel.latent_channel * self.bagel.latent_patch_size ** 2)
                  for s in seeds]
        if sp.same_latent:  # each drew its own first, as BagelSamplingLoop's generators do
            for sched in scheds[1:]:
                sched.initial = scheds[0].initial
        if getattr(req.sampling_params, "past_key_values", None) is not None:  # two stages (never with think)
            context, fed = self._received_context(prompt, req.sampling_params)
        else:
            context, fed = self._rollout_context(prompt, sp)
        latents = self._rollout_denoise(context, scheds, sp, shape)
        images = np.stack([np.asarray(self._decode_image_from_latent(self.bagel, self.vae, x, shape), np.uint8)
                           for x in latents])
        paths = [sched.trajectory() for sched in scheds]
        ids, mask = pad_ids([fed] * n)
        empty = dict(negative_prompt_ids=np.zeros((n, 0), np.int32),
                     negative_prompt_mask=np.zeros((n, 0), bool)) if sp.cfg_text_scale > 1 else {}
        batch = TrajectoryBatch.assembled(  # validated where it crosses into a process
            images=images, latents=np.stack([p["latents"] for p in paths]),
            log_probs=np.stack([p["log_probs"] for p in paths]), sigmas=sigmas,
            step_index=np.stack([p["step_index"] for p in paths]),
            prompt_ids=ids.numpy().astype(np.int32), prompt_mask=mask.numpy(), **empty, prompts=[prompt] * n,
            group_ids=np.zeros(n, np.int64), seeds=np.asarray(seeds, np.int64),
            policy_versions=np.full(n, self.policy_version, np.int64),
            final_latents=np.stack([p["final"] for p in paths]) if sp.keep_final else None)
        # BAGEL's post-processing is the identity: the uint8 images as they are, not pack_trajectories' float copy
        return output_cls(**{**pack_trajectories(batch), "output": torch.from_numpy(images)})

    doc = "vLLM-Omni's BagelPipeline running a request's samples in lockstep (see the module docstring)."
    namespace = {"__init__": __init__, "load_weights": load_weights, "_autocast": _autocast,
                 "_on_device": _on_device, "_rollout_context": _rollout_context, "_received_context": _received_context,
                 "_rollout_denoise": _rollout_denoise, "forward": forward,
                 "lora_component": spec.LORA_COMPONENT, "__module__": __name__,
                 "__qualname__": "FlowGRPOBagelPipeline", "__doc__": doc}
    return type("FlowGRPOBagelPipeline", (base,), namespace)


def _pipeline_class() -> type:
    from vllm_omni.diffusion.data import DiffusionOutput
    from vllm_omni.diffusion.models.bagel.bagel_transformer import NaiveCache
    from vllm_omni.diffusion.models.bagel.pipeline_bagel import BagelPipeline

    return build_pipeline_class(BagelPipeline, DiffusionOutput, NaiveCache)


def __getattr__(name: str):
    """Build (once) the class that needs vLLM-Omni, when vLLM-Omni's loader asks for it by name."""
    if name != "FlowGRPOBagelPipeline":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = _pipeline_class()
    return value
