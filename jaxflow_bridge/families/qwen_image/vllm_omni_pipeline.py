"""Our Qwen-Image rollout inside vLLM-Omni 0.20: the custom pipeline class and its request codec (the result's
codec and the workers' extension are the engine's, `jaxflow_bridge/engines/vllm_omni/{codec,worker}.py`).

vLLM-Omni builds a custom pipeline from `custom_pipeline_args={"pipeline_class": "<module>.<Class>"}`: its worker
calls `vllm.utils.import_utils.resolve_obj_by_qualname`, i.e. `getattr(importlib.import_module(module), Class)`
(vllm_omni/diffusion/model_loader/diffusers_loader.py), then `Class(od_config=...)`. This module therefore
imports without vLLM-Omni (CPU machines, tests) and builds its vLLM-Omni subclasses on first attribute access
(PEP 562 `__getattr__`):

- `FlowGRPOQwenImagePipeline`: vLLM-Omni's `QwenImagePipeline` (its loading, fused transformer, text encoder,
  VAE) running `SamplingLoop.generate`: one text-encoder pass, CFG positive/negative in one forward or two
  (`cfg_forward`), float32 latents between steps, sigma in float32 to the timestep embedding (`Fp32Timestep`; vLLM-Omni's
  `QwenTimestepProjEmbeddings` has the same call and cast as diffusers'), per-sample CPU generators, seeds and
  SDE windows, the torch SDE of `jaxflow_bridge.rollout.sde`. The engine's start-up warm-up request gets an empty
  result (`jaxflow_bridge.engines.vllm_omni.codec.is_warmup_request`); other requests without our `extra_args`
  (plain text-to-image requests) run the stock pipeline.

With JAXFLOW_ROLLOUT_TRACE=DIR in the workers' environment, the JAXFLOW_ROLLOUT_TRACE_AT-th rollout request (default
3) a worker serves runs under torch.profiler and its CUDA kernels go to DIR (scripts/bench_rollout_lora.py reads them).

The class inherits `SamplingLoop` ahead of vLLM-Omni's pipeline, so the loop's methods win: they only touch
attributes vLLM-Omni's pipeline has under the same names, plus the few aliases `__init__` adds.
Numerics that differ from diffusers sit inside vLLM-Omni's transformer: RoPE applied with cos/sin cast to the
model dtype (by default in our torch ops, `jaxflow_bridge.families.qwen_image.qk_rope`, which torch.compile fuses), its
attention backends (masked varlen FlashAttention for padded text; FA3 on Hopper,
`jaxflow_bridge.engines.vllm_omni.fa_version`), fused QKV.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from jaxflow_bridge.contract.schedule import CFG_FORWARDS
from jaxflow_bridge.engines.vllm_omni.codec import is_warmup_request, pack_trajectories
from jaxflow_bridge.engines.vllm_omni.fa_version import FA_VERSIONS, use_fa3
from jaxflow_bridge.engines.vllm_omni.bias_reload import load_with_biases_again
from jaxflow_bridge.engines.vllm_omni.startup import use_compile_threads
from jaxflow_bridge.families.qwen_image.linear_gelu import install_gelu_epilogue
from jaxflow_bridge.rollout.kernels.lora_linear import install_fused_apply
from jaxflow_bridge.sync.merge import MergedLoRA
from jaxflow_bridge.families.qwen_image import spec
from jaxflow_bridge.families.qwen_image.diffusers_pipeline import text_tower
from jaxflow_bridge.rollout.fingerprint import TensorHead, weights_fingerprint
from jaxflow_bridge.families.qwen_image.qk_rope import QK_OPS, use_native_qk
from jaxflow_bridge.families.qwen_image.random_init import random_named_weights
from jaxflow_bridge.rollout.sampling import Fp32Timestep, SamplingLoop, SamplingParams

log = logging.getLogger(__name__)
PIPELINE_CLASS = f"{__name__}.FlowGRPOQwenImagePipeline"
# SamplingParams fields carried by OmniDiffusionSamplingParams attributes, and those carried in its extra_args.
PARAM_FIELDS = ("height", "width", "num_inference_steps", "true_cfg_scale", "max_sequence_length", "seed")
EXTRA_FIELDS = ("noise_level", "sde_type", "solver", "sde_window_size", "sde_window_range", "same_latent",
                "keep_final")
# how LoRA'd linears run (the engines' one vocabulary, jaxflow_bridge/sync/sinks.py): "layers" (LoRA layers through
# jaxflow_bridge/rollout/kernels/lora_linear.py's fused apply), "folder" (vLLM-Omni's own: its per-slice apply of the
# adapter its loader read) or "merged" (the adapter merged into the base weights, jaxflow_bridge/sync/merge.py)
LORA_APPLY = ("layers", "folder", "merged")
# the MLP's tanh GELU: in the in-projection's cuBLASLt epilogue where no LoRA layer wraps it
# (jaxflow_bridge/families/qwen_image/linear_gelu.py), or vLLM-Omni's separate elementwise kernel
GELU = ("epilogue", "separate")
# a torch.profiler trace (CUDA kernels) of the Nth rollout request a worker serves, written to TRACE_ENV's folder
TRACE_ENV, TRACE_AT_ENV = "JAXFLOW_ROLLOUT_TRACE", "JAXFLOW_ROLLOUT_TRACE_AT"
PACKED = "prompts"  # a packed request's extra_args entry: its prompts, one sample each (`encode_packed`)


# ------------------------------------------------------------------------------------------ request codec


def encode_request(prompt: str, sampling: SamplingParams, seeds, policy_version: int) -> tuple[dict, dict]:
    """(prompt dict, OmniDiffusionSamplingParams kwargs) for n = len(seeds) samples of one prompt."""
    fields = {f: getattr(sampling, f) for f in PARAM_FIELDS}
    extra = {f: getattr(sampling, f) for f in EXTRA_FIELDS}
    extra["sde_window_range"] = list(extra["sde_window_range"])
    extra.update(seeds=[int(s) for s in seeds], policy_version=int(policy_version))
    kwargs = {**fields, "num_outputs_per_prompt": len(seeds), "extra_args": extra}
    return {"prompt": prompt, "negative_prompt": sampling.negative_prompt}, kwargs


def encode_packed(prompts: list[str], sampling: SamplingParams, seeds, policy_version: int) -> tuple[dict, dict]:
    """One request for several prompts of one sample each (the eval's calls; vLLM-Omni 0.20 runs one request at a
    time, so the prompts share its forwards): vLLM-Omni sees the first prompt and num_outputs_per_prompt =
    len(prompts), the images the request returns; every prompt rides in extra_args[PACKED], prompt-major with
    `seeds`."""
    if len(seeds) != len(prompts):
        raise ValueError(f"a packed request holds one sample per prompt: {len(seeds)} seeds for {len(prompts)} "
                         f"prompts")
    text, kwargs = encode_request(prompts[0], sampling, seeds, policy_version)
    kwargs["extra_args"][PACKED] = list(prompts)
    return text, kwargs


def is_rollout_request(params) -> bool:
    """Whether OmniDiffusionSamplingParams came from `encode_request` (its extra_args carry per-sample seeds)."""
    return "seeds" in (getattr(params, "extra_args", None) or {})


def decode_request(prompts: list, params) -> tuple[list[str], SamplingParams, int, list[int], int]:
    """(the request's prompts, SamplingParams, n per prompt, seeds, policy_version) back from a request's prompts
    and sampling params: one prompt's n samples, or a packed request's prompts of one sample each
    (`encode_packed`); ValueError for a request neither carries."""
    if len(prompts) != 1 or not isinstance(prompts[0], dict):
        raise ValueError(f"a rollout request carries one prompt dict, got {prompts!r}")
    extra = params.extra_args
    values = {f: getattr(params, f) for f in PARAM_FIELDS}
    values.update({f: extra[f] for f in EXTRA_FIELDS}, sde_window_range=tuple(extra["sde_window_range"]),
                  negative_prompt=prompts[0]["negative_prompt"])
    texts, n, seeds = [prompts[0]["prompt"]], params.num_outputs_per_prompt, list(extra["seeds"])
    if PACKED in extra:
        texts, n = extra[PACKED], 1
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts) or not texts \
                or texts[0] != prompts[0]["prompt"] or not len(texts) == params.num_outputs_per_prompt == len(seeds):
            raise ValueError(f"a packed rollout request carries its prompts in extra_args[{PACKED!r}], the first the "
                             f"request's own, one output and one seed each (encode_packed); got {texts!r} for prompt "
                             f"{prompts[0]['prompt']!r}, num_outputs_per_prompt={params.num_outputs_per_prompt}, "
                             f"{len(seeds)} seeds")
    return list(texts), SamplingParams(**values), n, seeds, int(extra["policy_version"])


# ------------------------------------------------------------------------------------------ the classes


def txt_seq_lens_from_mask(module, args, kwargs):
    """vLLM-Omni's transformer takes the text lengths explicitly (its RoPE spans max(txt_seq_lens), the padded
    width here); diffusers derives them from the mask. Forward pre-hook, so `velocity` stays shared."""
    if kwargs.get("txt_seq_lens") is None and kwargs.get("encoder_hidden_states_mask") is not None:
        kwargs["txt_seq_lens"] = kwargs["encoder_hidden_states_mask"].sum(dim=1).tolist()
    return args, kwargs


PIPELINE_OPTIONS = {"lora_apply": LORA_APPLY, "qk_ops": QK_OPS, "fa_version": FA_VERSIONS, "cfg_forward": CFG_FORWARDS,
                    "gelu": GELU}


def pipeline_options(args: dict) -> dict:
    """custom_pipeline_args' options, each its default (the first choice) where absent; ValueError naming the first
    one that is none of its choices. The engine checks them before it starts vLLM-Omni, the pipeline again in the
    worker that builds it."""
    options = {name: str(args.get(name, choices[0])) for name, choices in PIPELINE_OPTIONS.items()}
    for name, value in options.items():
        if value not in PIPELINE_OPTIONS[name]:
            raise ValueError(f"{name}={value!r}; choose one of {PIPELINE_OPTIONS[name]}")
    return options


class TextRequests:
    """What a Qwen-Image pipeline class reads of a request and keeps of its text encoder (`build_pipeline_class`'s
    `requests`; an edit family's adds its reference images and keeps the whole VL encoder)."""

    text_model = staticmethod(text_tower)

    def setup_requests(self, od_config) -> None:
        """Anything the family's requests need beyond vLLM-Omni's pipeline (nothing for text-to-image)."""

    @staticmethod
    def read_request(prompts: list, params) -> tuple[list[str], SamplingParams, int, list[int], int, None]:
        """`decode_request`'s fields and the prompts' reference images (none)."""
        return (*decode_request(prompts, params), None)


def build_pipeline_class(base: type, output_cls, lora_layer_cls: type | None = None,
                         attention_fa3: Callable[[], int | None] | None = None, gelu_cls: type | None = None,
                         requests: type = TextRequests, name: str = "FlowGRPOQwenImagePipeline") -> type:
    """Our pipeline as a subclass of `SamplingLoop` and `base` (vLLM-Omni's QwenImagePipeline); `output_cls`
    builds its results (vLLM-Omni's DiffusionOutput); `lora_layer_cls` (vLLM-Omni's diffusion LoRA layer base class)
    gets `jaxflow_bridge.rollout.kernels.lora_linear`'s fused apply unless custom_pipeline_args say
    lora_apply="folder"; the attention's q/k norms and rotary become `qk_rope`'s unless
    they say qk_ops="vllm"; `attention_fa3` (`jaxflow_bridge.engines.vllm_omni.fa_version.use_fa3`) runs unless they
    say fa_version="2"; `gelu_cls` (vLLM-Omni's ColumnParallelApproxGELU) gets
    `jaxflow_bridge.families.qwen_image.linear_gelu`'s forward unless they say gelu="separate";
    custom_pipeline_args' cfg_forward sets `SamplingLoop.cfg_forward`; `requests` (ahead of `SamplingLoop` in the
    class's bases) reads the requests and keeps the text encoder's part the family needs; `name` is the class's. All
    are parameters so tests can run it on diffusers components."""

    def __init__(self, *, od_config, **kwargs):
        base.__init__(self, od_config=od_config, **kwargs)
        self.text_encoder = self.text_model(self.text_encoder)  # text-to-image: its vision tower and head never run
        args = getattr(od_config, "custom_pipeline_args", None) or {}
        use_compile_threads(args)  # Inductor's threads, vLLM's forced 1 undone (engines/vllm_omni/startup.py)
        options = pipeline_options(args)
        if lora_layer_cls is not None and options["lora_apply"] == "layers":
            install_fused_apply(lora_layer_cls)
        if gelu_cls is not None and options["gelu"] == "epilogue":
            install_gelu_epilogue(gelu_cls)
        if attention_fa3 is not None and options["fa_version"] == "auto":
            version = attention_fa3()
            log.info("fa_version=auto: the diffusion attention's FlashAttention fallback runs %s",
                     f"FA{version}" if version else "as vLLM-Omni chose")
        if options["qk_ops"] == "compiled":
            log.info("qk_ops=compiled: %d attention modules run the q/k norms and rotary in torch ops",
                     use_native_qk(self.transformer))
        self.cfg_forward = options["cfg_forward"]
        self.template, self.drop = self.prompt_template_encode, self.prompt_template_encode_start_idx
        self.scheduler_config = dict(self.scheduler.config)
        if not hasattr(self.transformer, "config"):  # vLLM-Omni's transformer: its folder config, diffusers-style
            self.transformer.config = od_config.tf_model_config
        self.fp32_timestep = Fp32Timestep(self.transformer)
        if "txt_seq_lens" in inspect.signature(self.transformer.forward).parameters:
            self.transformer.register_forward_pre_hook(txt_seq_lens_from_mask, with_kwargs=True)
        self.policy_version = self.rollout_requests = 0
        self.random_seed = args.get("random_seed")
        self.random_fingerprint = None
        self.merged_lora = MergedLoRA() if options["lora_apply"] == "merged" else None
        self.setup_requests(od_config)

    def load_weights(self, weights):
        """vLLM-Omni's weight loading, then every bias again in a call of its own (vLLM 0.20's online FP8 loses a
        quantized linear's bias within the call: `jaxflow_bridge/engines/vllm_omni/bias_reload.py`); with `random_seed`
        (custom_pipeline_args) the folder's transformer weights are never read: the shared random spec's tensors are
        drawn on the GPU one at a time and go through the same loader (which fuses q/k/v), and their fingerprint is
        kept for the trainer's check."""
        if self.random_seed is None:
            return load_with_biases_again(lambda w: base.load_weights(self, w), weights)
        heads = []

        def drawn():
            config = json.loads((Path(self.od_config.model) / "transformer" / "config.json").read_text())
            for name, t in random_named_weights(config, int(self.random_seed), self.dtype, self.device):
                heads.append((name, TensorHead.of(t)))
                yield f"transformer.{name}", t

        loaded = load_with_biases_again(lambda w: base.load_weights(self, w), drawn())
        self.random_fingerprint = weights_fingerprint(heads)
        return loaded

    def dtype(self) -> torch.dtype:
        return next(self.transformer.parameters()).dtype

    def forward(self, req, *args, **kwargs):
        """A rollout request -> DiffusionOutput with our trajectory; vLLM-Omni's start-up warm-up -> an empty one
        (`is_warmup_request`); any other request -> the stock pipeline."""
        if not is_rollout_request(req.sampling_params):
            return output_cls() if is_warmup_request(req) else base.forward(self, req, *args, **kwargs)
        if self.merged_lora is not None and self.merged_lora.previous is not None and not self.merged_lora.serving:
            raise RuntimeError("the merged LoRA's base weights are being restored: serve the next adapter first")
        texts, sampling, n, seeds, self.policy_version, references = self.read_request(req.prompts,
                                                                                      req.sampling_params)
        self.rollout_requests += 1
        folder = os.environ.get(TRACE_ENV)
        if not folder or self.rollout_requests != int(os.environ.get(TRACE_AT_ENV, "3")):
            return output_cls(**pack_trajectories(self.generate(texts, n, sampling, seeds, references)))
        cuda = torch.cuda.is_available()
        activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
        with torch.profiler.profile(activities=[activity]) as prof:
            start = time.perf_counter()
            batch = self.generate(texts, n, sampling, seeds, references)
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
        Path(folder).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(f"{folder}/rollout-{os.getpid()}-{self.rollout_requests}-{wall:.3f}s.json")
        return output_cls(**pack_trajectories(batch))

    doc = f"vLLM-Omni's {base.__name__} serving SamplingLoop's FlowGRPO rollout (see the module docstring)."
    namespace = {"__init__": __init__, "load_weights": load_weights, "dtype": property(dtype), "forward": forward,
                 "lora_component": spec.LORA_COMPONENT, "__module__": requests.__module__,  # the family's module, where vLLM-Omni's loader finds it by name
                 "__qualname__": name, "__doc__": doc}
    return type(name, (requests, SamplingLoop, base), namespace)


def _pipeline_class() -> type:
    from vllm_omni.diffusion.data import DiffusionOutput
    from vllm_omni.diffusion.lora.layers.base_linear import (
        DiffusionBaseLinearLayerWithLoRA,
    )
    from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import (
        QwenImagePipeline,
    )
    from vllm_omni.diffusion.models.qwen_image.qwen_image_transformer import (
        ColumnParallelApproxGELU,
    )

    return build_pipeline_class(QwenImagePipeline, DiffusionOutput, DiffusionBaseLinearLayerWithLoRA, use_fa3,
                                ColumnParallelApproxGELU)


_LAZY = {"FlowGRPOQwenImagePipeline": _pipeline_class}


def __getattr__(name: str):
    """Build (once) the classes that need vLLM-Omni, when vLLM-Omni's loader asks for them by name."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = _LAZY[name]()
    return value
