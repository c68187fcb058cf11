"""Stand-ins for vLLM-Omni 0.20 (no vLLM-Omni here).

- Qwen-Image's fused transformer (module tree and layer sizes only), sized like tests/helpers.py's random_peft (width
  D, MLP width MLP, LAYERS blocks): FakeLinearBase, FakeFusedTransformer
- a rollout request to its pipeline (SAMPLING, SEEDS, omni_params), the engine's start-up warm-up request
  (warmup_request), the result (FakeDiffusionOutput) and its QwenImagePipeline on the tiny diffusers components
  (FakeOmniQwenImagePipeline)
- BAGEL: `Bagel` (BagelPipeline.bagel) at the tiny BAGEL's sizes, its vLLM linears and the `stacked_params_mapping`
  its load_weights leaves (FakeBagel, BAGEL_STACKED_PARAMS); its computing stand-in over the bagel_torch engine's
  model is tests/helpers_vllm_omni_bagel.py
- the LoRA manager's slots (FakeManager), and the package itself: AsyncOmni over one in-process worker with our
  extension, the BAGEL deploy file in its folder (install_fake_vllm_omni), whose add_lora loads and activates the
  adapter in the manager's slots
- how worker RPC arguments and replies cross vLLM-Omni's process boundaries (omni_msgpack_round_trip,
  pickle_round_trip)
- a synthetic trajectory batch and a byte-exact comparison of two (synthetic_batch, assert_batches_equal)
"""
import dataclasses
import pickle
import sys
import types
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import torch

from jaxflow_bridge.contract.lora import adapter_spec, lora_pairs, read_peft
from jaxflow_bridge.sync.binding import bind_lora_modules
from jaxflow_bridge.contract.trajectory import TrajectoryBatch
from jaxflow_bridge.rollout.sampling import SamplingParams
from jaxflow_bridge.families.bagel.tiny import TINY_LLM, TINY_VIT
from jaxflow_bridge.sync.vllm_omni_slots import lora_component, lora_module_table
from jaxflow_bridge.engines.vllm_omni.worker import RolloutWorkerMethods
from tests.helpers import LAYERS, MLP, D

_WEIGHTS = torch.Generator().manual_seed(0)


class FakeLinearBase(torch.nn.Module):
    """vLLM's LinearBase as the table sees it: input_size, output_size, and output_sizes when fused; a bf16 weight
    (out, in) drawn from one seeded generator (a fresh tree in a fresh process holds the same values)."""

    def __init__(self, fan_in: int, *outs: int):
        super().__init__()
        self.input_size, self.output_size = fan_in, sum(outs)
        if len(outs) > 1:
            self.output_sizes = list(outs)
        weight = torch.randn(sum(outs), fan_in, generator=_WEIGHTS) * fan_in ** -0.5
        self.weight = torch.nn.Parameter(weight.to(torch.bfloat16), requires_grad=False)


def _mlp() -> torch.nn.Module:
    gelu = torch.nn.Module()
    gelu.proj = FakeLinearBase(D, MLP)
    mlp = torch.nn.Module()
    mlp.net = torch.nn.ModuleList([gelu, torch.nn.Identity(), FakeLinearBase(MLP, D)])
    return mlp


class FakeFusedTransformer(torch.nn.Module):
    """Module tree of vLLM-Omni 0.20's QwenImageTransformer2DModel: fused to_qkv / add_kv_proj, `to_out`."""

    packed_modules_mapping = {"to_qkv": ["to_q", "to_k", "to_v"], "add_kv_proj": ["add_q_proj", "add_k_proj",
                                                                                  "add_v_proj"]}

    def __init__(self, kv: int = D):
        super().__init__()
        self.img_in, self.txt_in, self.proj_out = FakeLinearBase(64, D), FakeLinearBase(16, D), FakeLinearBase(D, 64)
        blocks = []
        for _ in range(LAYERS):
            block = torch.nn.Module()
            block.attn = torch.nn.Module()
            block.attn.to_qkv, block.attn.add_kv_proj = FakeLinearBase(D, D, kv, kv), FakeLinearBase(D, D, kv, kv)
            block.attn.to_out, block.attn.to_add_out = FakeLinearBase(D, D), FakeLinearBase(D, D)
            block.attn.norm_q = torch.nn.RMSNorm(D)
            block.img_mod = torch.nn.Sequential(torch.nn.SiLU(), FakeLinearBase(D, 6 * D))
            block.txt_mod = torch.nn.Sequential(torch.nn.SiLU(), FakeLinearBase(D, 6 * D))
            block.img_mlp, block.txt_mlp = _mlp(), _mlp()
            blocks.append(block)
        self.transformer_blocks = torch.nn.ModuleList(blocks)


# ---------------------------------------------------------------------------------------------- the pipeline

SAMPLING = SamplingParams(height=16, width=24, num_inference_steps=3, true_cfg_scale=4.0, noise_level=1.2,
                          sde_window_size=1, sde_window_range=(0, 2), max_sequence_length=64, seed=5)
SEEDS = [10, 11]


def omni_params(kwargs: dict) -> SimpleNamespace:
    """Stand-in for OmniDiffusionSamplingParams built from encode_request's kwargs."""
    return SimpleNamespace(**kwargs)


def warmup_request(prompt: dict | None = None) -> SimpleNamespace:
    """The request vLLM-Omni 0.20's engine sends once at start (`DiffusionEngine._dummy_run`): "dummy run" (`prompt`
    for a model taking images: with its blank 512 x 512 image), 512 x 512, one step, CFG off."""
    params = SimpleNamespace(height=512, width=512, num_inference_steps=1, guidance_scale=0.0, num_outputs_per_prompt=1,
                             seed=None, extra_args={"cfg_text_scale": 1.0, "cfg_img_scale": 1.0})
    return SimpleNamespace(prompts=[prompt or {"prompt": "dummy run"}], request_ids=["dummy_req_id"],
                           sampling_params=params)


@dataclasses.dataclass
class FakeDiffusionOutput:
    """vLLM-Omni 0.20's DiffusionOutput: the fields our pipelines fill, every one optional; `_dummy_run` reads
    `error`."""

    output: object = None
    trajectory_latents: object = None
    trajectory_log_probs: object = None
    custom_output: dict = dataclasses.field(default_factory=dict)
    error: str | None = None


class FakeOmniQwenImagePipeline(torch.nn.Module):
    """What our class uses of vLLM-Omni's QwenImagePipeline, on the tiny diffusers components."""

    def __init__(self, *, od_config, prefix=""):
        from diffusers import QwenImagePipeline

        super().__init__()
        pipe = QwenImagePipeline.from_pretrained(od_config.model, local_files_only=True)
        self.od_config, self.scheduler, self.tokenizer = od_config, pipe.scheduler, pipe.tokenizer
        self.text_encoder, self.vae, self.transformer = pipe.text_encoder, pipe.vae, pipe.transformer
        self.prompt_template_encode = pipe.prompt_template_encode
        self.prompt_template_encode_start_idx = pipe.prompt_template_encode_start_idx
        self.vae_scale_factor, self.device = pipe.vae_scale_factor, torch.device("cpu")

    def forward(self, req):
        return "stock pipeline"

    def load_weights(self, weights):
        """vLLM-Omni's AutoWeightsLoader routes "transformer.*" to the transformer (diffusers names here)."""
        params, loaded = dict(self.transformer.named_parameters()), set()
        with torch.no_grad():
            for name, t in weights:
                params[name.removeprefix("transformer.")].copy_(t)
                loaded.add(name)
        return loaded


# ---------------------------------------------------------------------------------------------- BAGEL

# what vLLM-Omni 0.20's Qwen2MoTForCausalLM.load_weights sets (bagel_transformer.py): (fused, slice, shard id)
BAGEL_STACKED_PARAMS = [(".qkv_proj_moe_gen", ".q_proj_moe_gen", "q"), (".qkv_proj_moe_gen", ".k_proj_moe_gen", "k"),
                        (".qkv_proj_moe_gen", ".v_proj_moe_gen", "v"), (".qkv_proj", ".q_proj", "q"),
                        (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
                        (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]


class FakeBagel(torch.nn.Module):
    """vLLM-Omni 0.20's `Bagel` at the tiny BAGEL's sizes (tiny_bagel.py) as our side sees it: the latent geometry
    and the module tree: per decoder layer both experts' QKVParallelLinear `qkv_proj[_moe_gen]`, RowParallelLinear
    `o_proj[_moe_gen]`, BagelMLP `mlp[_moe_gen]` (`gate_up_proj` 2 slices, `down_proj`); the connector's vLLM
    linears; plain nn.Linear LM head and latent heads. `stacked` sets the language model's `stacked_params_mapping`
    (its load_weights does, before LoRA starts)."""

    latent_channel, latent_patch_size = 16, 2

    def __init__(self, stacked: bool = True):
        super().__init__()
        d, m, heads = TINY_LLM["hidden_size"], TINY_LLM["intermediate_size"], TINY_LLM["num_attention_heads"]
        q, kv = d, TINY_LLM["num_key_value_heads"] * d // heads
        layers = []
        for _ in range(TINY_LLM["num_hidden_layers"]):
            layer = torch.nn.Module()
            layer.self_attn = torch.nn.Module()
            for g in ("", "_moe_gen"):
                setattr(layer.self_attn, f"qkv_proj{g}", FakeLinearBase(d, q, kv, kv))
                setattr(layer.self_attn, f"o_proj{g}", FakeLinearBase(q, d))
                mlp = torch.nn.Module()
                mlp.gate_up_proj, mlp.down_proj = FakeLinearBase(d, m, m), FakeLinearBase(m, d)
                setattr(layer, f"mlp{g}", mlp)
            layers.append(layer)
        self.language_model = torch.nn.Module()
        self.language_model.model = torch.nn.Module()
        self.language_model.model.layers = torch.nn.ModuleList(layers)
        self.language_model.lm_head = torch.nn.Linear(d, 8, bias=False)
        if stacked:
            self.language_model.stacked_params_mapping = BAGEL_STACKED_PARAMS
        self.connector = torch.nn.Module()
        self.connector.fc1, self.connector.fc2 = FakeLinearBase(TINY_VIT["hidden_size"], d), FakeLinearBase(d, d)
        latent = self.latent_channel * self.latent_patch_size ** 2
        self.vae2llm, self.llm2vae = torch.nn.Linear(latent, d), torch.nn.Linear(d, latent)


# ---------------------------------------------------------------------------------------------- LoRA manager


class FakeManager:
    """vLLM-Omni 0.20's DiffusionLoRAManager as `write_lora_slots` sees it: wrapped layers keyed by full module name
    (`component.` + the table's name) with one (1, 1, r, in) / (1, 1, out_i, r) slot pair per slice, and the active
    adapter's CPU copy per module: zeros, or with `scale` the modules' (A, B) arrays loaded and activated as vLLM-Omni
    does (bf16, B times `scale`, into the copy and the slots of each module's layer and slice)."""

    def __init__(self, table: dict, modules: dict, rank: int, component: str = "transformer", adapter_id: int = 7,
                 scale: float | None = None):
        self._active_adapter_id = adapter_id
        self._lora_modules = {}
        for name, (fan_in, outs) in table["modules"].items():
            self._lora_modules[f"{component}.{name}"] = SimpleNamespace(
                lora_a_stacked=tuple(torch.zeros(1, 1, rank, fan_in, dtype=torch.bfloat16) for _ in outs),
                lora_b_stacked=tuple(torch.zeros(1, 1, o, rank, dtype=torch.bfloat16) for o in outs))
        masters = {m: SimpleNamespace(lora_a=torch.zeros(a.shape, dtype=torch.bfloat16),
                                      lora_b=torch.zeros(b.shape, dtype=torch.bfloat16))
                   for m, (a, b) in modules.items()}
        self._registered_adapters = {adapter_id: SimpleNamespace(get_lora=masters.get)}
        self.masters = masters
        if scale is None:
            return
        for module, (layer, slot) in bind_lora_modules(modules, rank, table).items():
            a, b = (torch.from_numpy(np.asarray(x, np.float32)) for x in modules[module])
            masters[module].lora_a.copy_(a)
            masters[module].lora_b.copy_(b * scale)
            wrapped = self._lora_modules[f"{component}.{layer}"]
            for i in range(len(wrapped.lora_a_stacked)) if slot is None else [slot]:
                wrapped.lora_a_stacked[i][0, 0].copy_(a)
            rows = [0, *np.cumsum([t.shape[2] for t in wrapped.lora_b_stacked])]
            for i in range(len(wrapped.lora_b_stacked)) if slot is None else [slot]:
                part = b[rows[i]:rows[i + 1]] if slot is None else b
                wrapped.lora_b_stacked[i][0, 0].copy_(part * scale)


# ---------------------------------------------------------------------------------------------- RPC transports


def omni_msgpack_round_trip(obj):
    """`obj` as it arrives after vLLM-Omni 0.20's msgpack (its OmniMsgpackEncoder / Decoder between a several-stage
    deployment's processes, on msgspec): a dataclass becomes the dict of its fields and a tuple a list; a numpy array
    comes back a read-only array from its bytes and a torch tensor a tensor, but an array of a void or object dtype
    (bfloat16 is void to numpy) and any other object (numpy scalars too) is refused with TypeError, as the encoder
    refuses them."""
    if obj is None or isinstance(obj, (bool, str, bytes)) or type(obj) in (int, float):
        return obj
    if isinstance(obj, (list, tuple)):
        return [omni_msgpack_round_trip(x) for x in obj]
    if isinstance(obj, dict):
        return {omni_msgpack_round_trip(k): omni_msgpack_round_trip(v) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: omni_msgpack_round_trip(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, np.ndarray) and obj.dtype.kind not in "OV":
        return np.frombuffer(np.ascontiguousarray(obj).tobytes(), obj.dtype).reshape(obj.shape)
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    raise TypeError(f"Object of type {type(obj).__name__} is not serializable")


def pickle_round_trip(obj):
    """`obj` as it arrives after pickle (vLLM's shared-memory message queue to a one-stage deployment's workers)."""
    return pickle.loads(pickle.dumps(obj))


# ---------------------------------------------------------------------------------------------- the package


class FakeWorker(RolloutWorkerMethods):
    """vLLM-Omni's diffusion worker extended with ours: its pipeline and its LoRA manager."""

    def __init__(self, pipeline):
        self.model_runner, self.lora_manager = SimpleNamespace(pipeline=pipeline), None


def install_fake_vllm_omni(monkeypatch, root, pipelines: dict, stages: int = 1, thinker=None) -> type:
    """Put a stand-in vLLM-Omni package in sys.modules (its folder `root/vllm_omni`, holding BAGEL's
    `deploy/bagel_single_stage.yaml` and `deploy/bagel.yaml`) and vLLM's `SamplingParams` for the test's duration;
    returns its AsyncOmni class.

    AsyncOmni(model, **kwargs) records its keywords, reports `stages` stages and builds one worker (on the last stage)
    whose pipeline is `pipelines[args["pipeline_class"]](od_config=...)` for the custom_pipeline_args given (top
    level, or `stage_<N>_` prefixed): `collective_rpc` calls the worker's methods on that stage (`stage_ids`
    recorded in `rpcs`; a thinker stage answers `{"todo": True}`), its `add_lora` puts a FakeManager of the adapter
    folder's modules over the pipeline's LoRA component, `generate` runs the pipeline's `forward` on the request the
    inline diffusion client builds; our workers' RPCs carry their arguments and replies as vLLM-Omni 0.20 does, pickled
    with one stage (`pickle_round_trip`), through msgpack with several (`omni_msgpack_round_trip`), a failure
    answered as its stage clients answer it ({"supported": False, "error": message} where the arguments do not
    encode or, with one stage, the method raised; {"error": True, "reason"} where a several-stage worker raised); with
    two stages `thinker(text)` -> (ids, kv, next position) stands in for the
    AR stage: its output first (`stage_id` 0, `request_output.prompt_token_ids`), then its KV and `kv_metadata` in
    the DiT's params, as vLLM-Omni's KV transfer sets them. `shutdown` sets `stopped`. Every instance is in
    `started`. OmniDiffusionSamplingParams, vLLM's SamplingParams and LoRARequest are SimpleNamespace."""
    package = root / "vllm_omni"
    (package / "deploy").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "deploy" / "bagel_single_stage.yaml").write_text("pipeline: bagel_single_stage\nasync_chunk: false\n")
    (package / "deploy" / "bagel.yaml").write_text("async_chunk: false\nstages: []\n")

    class AsyncOmni:
        started = []

        def __init__(self, model, **kwargs):
            self.model, self.kwargs, self.num_stages, self.requests, self.loaded = model, kwargs, stages, [], []
            self.stopped, self.thinker_requests, self.rpcs = False, [], []
            args = next(v for k, v in kwargs.items() if k.endswith("custom_pipeline_args"))
            od_config = SimpleNamespace(model=model, custom_pipeline_args=args)
            self.worker = FakeWorker(pipelines[args["pipeline_class"]](od_config=od_config))
            AsyncOmni.started.append(self)

        async def collective_rpc(self, method, args=(), stage_ids=None):
            self.rpcs.append((method, stage_ids))
            replies = []
            for stage in range(stages) if stage_ids is None else stage_ids:
                if stage != stages - 1:
                    replies.append({"todo": True})
                elif method in ("add_lora", "remove_lora"):  # vLLM-Omni's own: it rebuilds the LoRARequest itself
                    replies.append(getattr(self, f"_{method}")(*args))
                else:
                    replies.append(self._worker_rpc(method, args))
            return replies

        def _worker_rpc(self, method, args):
            wire = pickle_round_trip if stages == 1 else omni_msgpack_round_trip
            try:
                args = wire(args)
            except TypeError as e:
                return {"supported": False, "error": str(e)}
            try:
                return wire([getattr(self.worker, method)(*args)])
            except Exception as e:  # noqa: BLE001 - what the stage client sends back
                return {"supported": False, "error": str(e)} if stages == 1 else {"error": True, "reason": str(e)}

        async def generate(self, prompt, request_id, sampling_params_list):
            *first, params = sampling_params_list
            assert len(first) == stages - 1
            self.requests.append((prompt, params))
            if first:
                self.thinker_requests.append((prompt, first[0]))
                ids, kv, rope = thinker(prompt["prompt"])
                yield SimpleNamespace(stage_id=0, request_output=SimpleNamespace(prompt_token_ids=ids))
                params = SimpleNamespace(**vars(params), past_key_values=kv, kv_metadata={"ropes": [rope]})
            with torch.inference_mode():
                yield self.worker.model_runner.pipeline.forward(
                    SimpleNamespace(prompts=[prompt], sampling_params=params, request_ids=[request_id]))

        def _add_lora(self, request):
            tensors, config = read_peft(request.lora_path)
            pairs = lora_pairs(tensors)
            name, component = lora_component(self.worker.model_runner.pipeline)
            rank = next(iter(pairs.values()))[0].shape[0]
            self.worker.lora_manager = FakeManager(lora_module_table(component), pairs, rank, name,
                                                   request.lora_int_id, adapter_spec(config).alpha / rank)
            self.loaded.append(request)
            return True

        def _remove_lora(self, adapter_id):
            return True

        def shutdown(self):
            self.stopped = True

    modules = {name: types.ModuleType(name) for name in (
        "vllm_omni", "vllm_omni.entrypoints", "vllm_omni.entrypoints.async_omni", "vllm_omni.inputs",
        "vllm_omni.inputs.data", "vllm_omni.lora", "vllm_omni.lora.request", "vllm")}
    modules["vllm"].SamplingParams = SimpleNamespace
    modules["vllm_omni"].__file__ = str(package / "__init__.py")
    modules["vllm_omni.entrypoints.async_omni"].AsyncOmni = AsyncOmni
    modules["vllm_omni.inputs.data"].OmniDiffusionSamplingParams = SimpleNamespace
    modules["vllm_omni.lora.request"].LoRARequest = SimpleNamespace
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return AsyncOmni


def assert_batches_equal(a: TrajectoryBatch, b: TrajectoryBatch) -> None:
    """Every field of the two batches equal (arrays to the byte, dtype and shape too)."""
    for f in dataclasses.fields(TrajectoryBatch):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), f.name
        else:
            assert x == y, f.name


def synthetic_batch(n=3, cfg=True, dtype=ml_dtypes.bfloat16, seed=0) -> TrajectoryBatch:
    rng = np.random.default_rng(seed)
    mask = np.ones((n, 6), bool)
    mask[1, 4:] = False
    neg = dict(negative_prompt_embeds=rng.standard_normal((n, 2, 16)).astype(dtype),
               negative_prompt_mask=np.ones((n, 2), bool)) if cfg else {}
    return TrajectoryBatch(
        images=rng.integers(0, 256, (n, 40, 72, 3), np.uint8), latents=rng.standard_normal((n, 3, 45, 64), np.float32),
        log_probs=rng.standard_normal((n, 2), np.float32), sigmas=np.array([1.0, 0.7, 0.4, 0.2, 0.0], np.float32),
        step_index=np.array([[0, 1], [1, 2], [0, 1]][:n], np.int32),
        prompt_embeds=rng.standard_normal((n, 6, 16)).astype(dtype), prompt_mask=mask, **neg, prompts=["p"] * n, group_ids=np.zeros(n, np.int64),
        seeds=np.arange(n, dtype=np.int64), policy_versions=np.full(n, 4, np.int64))
