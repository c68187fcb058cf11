"""The GPU rollout engine: vLLM-Omni 0.20 (`AsyncOmni`) serving our FlowGRPO pipeline, inside the Ray actor.

Config keys: `engine` ("vllm_omni"), `model` (a local model folder saved in bf16, or a family's tiny model name: the
model kind, hence the pipeline and its options, comes from the folder, `jaxflow_bridge/engines/vllm_omni/kinds.py` and
the families' `vllm_omni_kind.py`), `dtype` ("bfloat16"; vLLM-Omni 0.20 runs bf16 folders only), `device` (None or
"cuda": the GPU Ray gave the actor), `random_seed` (optional: the transformer's weights are drawn on the GPU from this
seed by the shared spec, `jaxflow_bridge/contract/random_weights.py`, as with the diffusers engine; the folder needs
only `transformer/config.json`), `omni_args` (extra `AsyncOmni` keyword arguments, e.g. {"enforce_eager": True}),
`lora_apply` ("layers", the default: LoRA'd linears run `jaxflow_bridge/rollout/kernels/lora_linear.py`; "folder":
vLLM-Omni's own per-slice apply of the adapter its loader read, for comparison; "merged": the adapter merged into the base weights,
`jaxflow_bridge/sync/merge.py`), `cfg_forward` ("batched" or "split": true CFG's rows in one forward or two,
`jaxflow_bridge.rollout.sampling`), `qk_ops` ("compiled", the default: the attention's q/k norms and rotary in torch
ops that torch.compile fuses; "vllm": vLLM-Omni's own kernels, for comparison), `fa_version` ("auto", the default: FA3
on Hopper where vLLM-Omni would fall back to FA2, `jaxflow_bridge/engines/vllm_omni/fa_version.py`; "2": as vLLM-Omni
chooses), `gelu` ("epilogue", the default: the MLP's in-projection and tanh GELU in one cuBLASLt GEMM where no LoRA
layer wraps it; "separate": vLLM-Omni's elementwise kernel), `deploy` (a kind with several vLLM-Omni deployments:
"single_stage", the default, or "two_stage"), `quantization` ("none", the default, or "fp8": vLLM-Omni's FP8 DiT,
`rules.QUANTIZATIONS`; the LoRA then as layers, vLLM-Omni's own per-slice apply over the FP8 GEMM, never merged),
`compile_cache` (optional: the folder torch's compile caches go under in the workers, `startup.py`),
`request_images` (optional: the most samples a packed request holds, the driver's a training request's,
sample.group_size; without it a call's prompts go in one request).
Same calls and results as the diffusers engine. Each kind refuses the options its pipeline lacks (`pipeline_args`),
checks adapters' names (`adapter`) and brings its sampling parameters (`sampling`) and request encoder
(`encode_request`).

- generate: one request per prompt with `num_outputs_per_prompt=n` (one B=n forward, 2n with true CFG, per step), all
  submitted at once, the kind's `encode_request` splitting the knobs into OmniDiffusionSamplingParams fields and
  `extra_args`; a call of one sample per prompt (the eval's) goes packed (`codec.request_groups`, the kind's
  `encode_packed`), as vLLM-Omni 0.20 runs one request at a time.
- LoRA (`serve_lora`): one payload (`jaxflow_bridge/contract/lora_payload.py`), its names renamed for vLLM-Omni
  (`jaxflow_bridge.contract.lora.to_vllm_omni`), served by the workers' sink of `lora_apply`
  (`jaxflow_bridge/sync/vllm_omni_sinks.py`).
- two stages (`deploy="two_stage"`): the thinker (vLLM's AR engine) prefills each request's framed prompt and sends
  its KV to our pipeline on the DiT stage (one greedy token, think mode refused); worker RPCs and adapters go to the
  DiT stage alone, sleep and wake to both; the ids the thinker reports must be the trajectory's `prompt_ids`.
- worker RPCs: every argument and reply a plain value (the payload as `LoRAPayload.to_wire()`): vLLM-Omni pickles
  them to a one-stage deployment's workers but sends them to a several-stage one's DiT process through msgpack,
  which turns a dataclass into a dict, a tuple into a list, and refuses bfloat16 arrays. A stage's error dict
  (`rpc.rpc_errors`) is raised here. Sleep and wake go the same way: the actor process never creates a CUDA context.
AsyncOmni runs on an event loop in a background thread; the engine's methods block on it (one call at a time).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from pathlib import Path

import numpy as np

from jaxflow_bridge.contract.lora import (adapter_spec, lora_module, lora_pairs, read_peft, vllm_omni_adapter_config,
                                         write_peft)
from jaxflow_bridge.contract.engine_start import EngineStart
from jaxflow_bridge.contract.lora_payload import LoRAPayload
from jaxflow_bridge.contract.lora_shm import SharedAdapterFile, open_payload
from jaxflow_bridge.contract.schedule import sample_windows
from jaxflow_bridge.contract.trajectory import TrajectoryBatch
from jaxflow_bridge.rollout.engine import RolloutEngine, policy_version
from jaxflow_bridge.sync.binding import bind_lora_modules, check_lora_binding
from jaxflow_bridge.rollout.sampling import check_prompts, per_sample_seeds
from jaxflow_bridge.rollout.tensors import torch_to_numpy
from jaxflow_bridge.engines.vllm_omni.codec import longest_text, request_groups, unpack_trajectories
from jaxflow_bridge.engines.vllm_omni.gpu_memory import gpu_memory_used
from jaxflow_bridge.engines.vllm_omni.imports import export_package_path, import_omni, import_text_params
from jaxflow_bridge.engines.vllm_omni.kinds import family_of, model_kind
from jaxflow_bridge.engines.vllm_omni.rules import (engine_problems, family_problems, quantization_problems, refuse,
                                                   settings)
from jaxflow_bridge.engines.vllm_omni.rpc import ack_errors, rpc_errors, rpc_replies
from jaxflow_bridge.engines.vllm_omni.startup import (compile_cache_line, compile_threads, COMPILE_COUNTERS,
                                                     export_compile_caches)
from jaxflow_bridge.engines.vllm_omni.worker import WORKER_EXTENSION_CLASS

log = logging.getLogger(__name__)
LORA_ROOT = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


class VllmOmniEngine(RolloutEngine):
    """The `RolloutEngine` interface over one AsyncOmni engine."""

    name = "vllm_omni"
    config_keys = ("engine", "model", "dtype", "device", "random_seed", "omni_args", "lora_apply", "cfg_forward",
                   "qk_ops", "fa_version", "gelu", "deploy", "quantization", "compile_cache", "request_images")

    def __init__(self, config: dict):
        entry = time.monotonic()  # the start's parts (`self.start`, in `info()`): imports, AsyncOmni, our checks
        self.check_config(config)
        self.dtype = config.get("dtype", "bfloat16")
        refuse(engine_problems(self.dtype, config.get("device")))  # the validation stage's rules (rules.py): one copy
        threads = compile_threads()  # before `import vllm` overwrites the user's value
        async_omni, self._params_cls, self._lora_cls = import_omni()
        imported = time.monotonic()
        refuse(family_problems(family_of(config["model"]), **settings(config)))
        self.kind = model_kind(config["model"], self.dtype, config.get("deploy"))
        pipeline_args = self.kind.pipeline_args(config)  # refuses what the kind lacks, before anything loads
        self.quantization = config.get("quantization", "none")  # the DiT's linears: bf16, or FP8 (rules.QUANTIZATIONS)
        refuse(quantization_problems(self.quantization, pipeline_args.get("lora_apply", "layers")))
        start_args = self.kind.start_args({**pipeline_args, "compile_threads": threads}, WORKER_EXTENSION_CLASS)
        self._text_params_cls = import_text_params() if self.kind.stages > 1 else None
        self._dit = [self.kind.stages - 1]  # the diffusion stage: our pipeline, extension and LoRA
        self.model_path, self.size_multiple = str(self.kind.folder), self.kind.size_multiple
        self.random_seed = config.get("random_seed")
        self.request_images = config.get("request_images")
        if self.request_images is not None and (isinstance(self.request_images, bool) or
                                                not isinstance(self.request_images, int) or self.request_images < 1):
            raise ValueError(f"vllm_omni engine: request_images={self.request_images!r}; pass an int >= 1 (the "
                             f"samples a training request holds, sample.group_size) or leave it out")
        if self.random_seed is None:
            self.fingerprint = self.kind.fingerprint()
        self.policy_version, self.asleep = 0, False
        self._lora, self._lora_config, self._lora_bound, self._lora_ids = None, None, 0, 0
        self._lora_file = None  # `update_lora`'s arrays as a shared file in _lora_dir
        self._lora_dir = Path(tempfile.mkdtemp(prefix="jaxflow-lora-", dir=LORA_ROOT))
        weakref.finalize(self, shutil.rmtree, self._lora_dir, True)  # shared memory: free it with the engine
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="vllm-omni-loop", daemon=True).start()
        export_package_path()
        export_compile_caches(config.get("compile_cache"))
        # the workers' LoRA sink (sync/vllm_omni_sinks.py) is the pipeline's lora_apply; a kind whose pipeline takes
        # none (one on vLLM-Omni's own LoRA layers) syncs through their slots, as "layers" does
        self.lora_apply = pipeline_args.get("lora_apply", "layers")
        self.merged = self.lora_apply == "merged"  # adapters merged into the base weights
        self.fallbacks = 0  # in-place LoRA writes that failed (each logged; that update loaded a folder instead)
        kwargs = {**start_args, "dtype": self.dtype, "enable_sleep_mode": True, **config.get("omni_args", {})}
        if self.quantization != "none":  # vLLM-Omni hands it to its diffusion stages' OmniDiffusionConfig
            kwargs["quantization"] = self.quantization
        self.omni = self._run(self._start(async_omni, kwargs))
        started = time.monotonic()
        if self.omni.num_stages != self.kind.stages:  # one params object a stage, the DiT stage's RPC replies
            self.omni.shutdown()
            raise RuntimeError(f"vLLM-Omni started {self.omni.num_stages} stages for {self.model_path}; the vllm_omni "
                               f"engine expected {self.kind.stages} ({self.kind.stage_layout})")
        self._modules = rpc_replies(self._rpc("rollout_lora_modules"))[0]
        if self.random_seed is not None:  # what the workers drew, not what the spec promises
            self.fingerprint = rpc_replies(self._rpc("rollout_random_fingerprint"))[0]
        self.start = EngineStart.from_stamps(entry, imported, started, time.monotonic())
        self.compile_cache_hits = None  # the workers' compile-cache lookups, read after the first rollout

    async def _start(self, async_omni, kwargs):
        return async_omni(model=self.model_path, **kwargs)

    def _run(self, coro):
        """Run a coroutine on the engine's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _rpc(self, method: str, *args, every_stage: bool = False) -> list:
        """A worker RPC's results, from the diffusion stage (or `every_stage`); RuntimeError if a stage reports an
        error."""
        stages = None if every_stage else self._dit
        results = self._run(self.omni.collective_rpc(method=method, args=args, stage_ids=stages))
        errors = rpc_errors(results)
        if errors:
            raise RuntimeError(f"vLLM-Omni RPC {method} failed: {errors}")
        return results

    # -------------------------------------------------------------------------------------- generation

    def generate(self, prompts: list[str], n: int, sampling: dict, seeds=None, references=None) -> dict:
        """TrajectoryBatch.to_dict() of B = len(prompts) * n samples, prompt-major (sample b of prompt b // n); each
        request's text padded as it arrives, to `text_tokens` (without them: to the call's longest text).
        `references`: an edit model's images, one uint8 (R, H, W, 3) array per prompt, in its request once. With n == 1
        the prompts go packed (`request_groups`), the same samples, seeds and order."""
        sp = self.kind.sampling.from_dict(sampling)
        check_prompts(prompts, n)
        if references is not None and len(references) != len(prompts):
            raise ValueError(f"references: one array of images per prompt, got {len(references)} for "
                             f"{len(prompts)} prompts")
        self.check_awake()
        seeds = per_sample_seeds(len(prompts) * n, sp.seed if seeds is None else seeds)
        sample_windows(seeds, sp.sde_window_size, sp.sde_window_range, sp.num_inference_steps)
        thinker = self.kind.thinker_params(sp)  # two stages: the thinker's parameters first (refuses think mode)
        packs = self.kind.encode_packed is not None and references is None
        groups = request_groups(len(prompts), n, packs, self.request_images)
        requests = [(*self._encode([prompts[g] for g in group], sp, seeds[group.start * n:group.stop * n],
                                   None if references is None else [references[g] for g in group]), thinker)
                    for group in groups]
        outputs = self._run(self._generate_all(requests))
        if self.compile_cache_hits is None:
            self.compile_cache_hits = self._compile_cache_hits()
        parts = [unpack_trajectories(out, [prompts[g] for g in group], group.start, thinker_ids)
                 for group, (out, thinker_ids) in zip(groups, outputs)]
        return TrajectoryBatch.concat([b.padded(sp.text_tokens or longest_text(parts)) for b in parts]).to_dict()

    def _encode(self, prompts: list[str], sp, seeds, references) -> tuple[dict, dict]:
        """The kind's request for one prompt's samples, or several prompts' of one sample each (`encode_packed`: a
        kind that packs takes no reference images)."""
        if len(prompts) > 1:
            return self.kind.encode_packed(prompts, sp, seeds, self.policy_version)
        images = {} if references is None else {"references": references[0]}
        return self.kind.encode_request(prompts[0], sp, seeds, self.policy_version, **images)

    def _compile_cache_hits(self) -> dict:
        """The diffusion stage's workers' compile-cache lookups, summed, and logged; {} (said) where the RPC failed:
        a report, never a failed rollout."""
        try:
            replies = rpc_replies(self._rpc("rollout_compile_cache_counts"))
        except RuntimeError as exc:
            log.warning(f"vllm_omni: could not read the workers' torch compile caches: {exc}")
            return {}
        counts = {name: sum(int(r.get(name, 0)) for r in replies) for name in COMPILE_COUNTERS}
        log.info(compile_cache_line(counts))
        return counts

    async def _generate_all(self, requests):
        tag = uuid.uuid4().hex[:12]
        tasks = [asyncio.ensure_future(self._generate_one(f"rollout-{tag}-{g}", prompt, kwargs, thinker))
                 for g, (prompt, kwargs, thinker) in enumerate(requests)]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:  # a failed request stops the others (their cancellation aborts them in the engine)
                task.cancel()
            raise

    async def _generate_one(self, request_id: str, prompt: dict, kwargs: dict, thinker: list):
        """(the diffusion stage's output, the ids the thinker prefilled or None): with two stages the thinker's
        parameters (`thinker`) go first and its text output reports its prompt's ids."""
        params = [self._text_params_cls(**t) for t in thinker] + [self._params_cls(**kwargs, lora_request=self._lora)]
        final = thinker_ids = None
        async for output in self.omni.generate(prompt, request_id=request_id, sampling_params_list=params):
            if thinker and getattr(output, "stage_id", None) == 0:
                thinker_ids = list(output.request_output.prompt_token_ids)
            else:
                final = output
        if final is None:
            raise RuntimeError(f"vLLM-Omni returned nothing for request {request_id}")
        if thinker and thinker_ids is None:
            raise RuntimeError(f"vLLM-Omni's thinker stage reported no prompt ids for request {request_id}")
        return final, thinker_ids

    # -------------------------------------------------------------------------------------- LoRA

    def update_lora(self, tensors, version: int, adapter_config: dict | None = None) -> dict:
        """Serve a PEFT adapter (dict of arrays, or a path on this host) as policy `version` (`serve_lora`). The
        arrays reach the workers through this engine's own shared-memory file, in their own dtype: sent through
        vLLM-Omni's RPC, a full-size adapter (GBs) stalls it."""
        policy_version(version)
        if isinstance(tensors, (str, Path)):
            tensors, file_config = read_peft(tensors)
            adapter_config = adapter_config or file_config
        tensors = {k: v if isinstance(v, np.ndarray) else torch_to_numpy(v) for k, v in tensors.items()}
        dtypes = {v.dtype for v in tensors.values()}
        dtype = dtypes.pop().name if len(dtypes) == 1 else "float32"
        if self._lora_file is None or self._lora_file.dtype != dtype:
            self._lora_file = SharedAdapterFile(dtype, root=self._lora_dir)
        return self.update_lora_shared(self._lora_file.write_arrays(tensors), version, adapter_config)

    def update_lora_shared(self, manifest: dict, version: int, adapter_config: dict | None = None) -> dict:
        """Serve the adapter in a shared-memory file on this host (jaxflow_bridge/contract/lora_shm.py; the workers
        map it) as policy `version` (`serve_lora`); FileNotFoundError if the file is not here."""
        policy_version(version)
        open_payload(manifest)
        return self.serve_lora(LoRAPayload(int(version), dict(adapter_config or self._lora_config or {}),
                                           shared=manifest))

    def serve_lora(self, payload: LoRAPayload) -> dict:
        """{"version", "bound_modules", "seconds", "served": what the workers' sink now serves, "fallbacks": in-place
        writes failed so far}. The names and shapes are checked here (the kind's names, the engine's layer table),
        the values by the workers' sink; then by `lora_apply`: "merged" merges on the workers, "layers" writes in
        place once `add_lora` has loaded an adapter of the same config and modules, "folder" (and "layers" before
        that) loads a PEFT folder with `add_lora`. A refused adapter leaves the previous one serving. A failed
        in-place write is logged and counted, and that update loads a folder instead; the next one goes in place
        again."""
        self.check_awake()
        if not payload.config:
            raise ValueError("adapter_config (r, lora_alpha) is required for the first LoRA update")
        shapes = {k: v.shape for k, v in payload.tensors.items()} if payload.tensors is not None else \
            {k: tuple(s) for k, s in payload.shared["entries"]}
        vllm = self.kind.adapter(dict.fromkeys(shapes))  # its names, as the kind allows them
        names = {lora_module(k): lora_module(v) for k, v in zip(shapes, vllm)}
        pairs = lora_pairs({v: np.broadcast_to(np.uint8(0), shapes[k]) for k, v in zip(shapes, vllm)})
        t = time.perf_counter()
        try:
            bound = len(bind_lora_modules(pairs, adapter_spec(payload.config).rank, self._modules, check_values=False))
        except ValueError:
            if self.merged:
                self._rpc("rollout_serve_again")
            raise
        if self.merged:
            reply = self._apply(payload, names)
        elif self.lora_apply == "layers" and self._lora is not None and payload.config == self._lora_config \
                and bound == self._lora_bound:
            try:
                reply = self._apply(payload, names)
            except RuntimeError as exc:  # the slots are not where this vLLM-Omni keeps them: said and counted
                self.fallbacks += 1
                log.error(f"vllm_omni engine: in-place LoRA write of version {payload.version} failed "
                          f"({self.fallbacks} so far); loading it from a PEFT folder instead: {exc}")
                reply = self._load(payload, names)
        else:
            reply = self._load(payload, names)
        self._lora_config, self._lora_bound = dict(payload.config), reply["written"]
        self.policy_version = int(payload.version)
        return {"version": self.policy_version, "bound_modules": self._lora_bound, "served": reply["served"],
                "seconds": time.perf_counter() - t, "fallbacks": self.fallbacks}

    def _apply(self, payload: LoRAPayload, names: dict, loaded_id: int | None = None) -> dict:
        """The workers' sink serving `payload` (`RolloutWorkerMethods.rollout_apply_lora`); ValueError if refused."""
        reply = rpc_replies(self._rpc("rollout_apply_lora", self.lora_apply, payload.to_wire(), names, loaded_id))[0]
        if "refused" in reply:
            raise ValueError(reply["refused"])
        return reply

    def _load(self, payload: LoRAPayload, names: dict) -> dict:
        """`payload` written as a PEFT folder under /dev/shm (vLLM-Omni's names; values checked here) and loaded
        by vLLM-Omni's `add_lora`, the previous adapter dropped; then read back by the workers' sink."""
        tensors = self.kind.adapter(payload.arrays())
        check_lora_binding(lora_pairs(tensors), adapter_spec(payload.config).rank, self._modules)
        self._lora_ids += 1
        folder = write_peft(self._lora_dir / f"adapter-{self._lora_ids}", tensors,
                            vllm_omni_adapter_config(payload.config))
        request = self._lora_cls(lora_name=f"policy-v{int(payload.version)}", lora_int_id=self._lora_ids,
                                 lora_path=str(folder))
        self._run(self._swap_lora(request))
        self._lora = request
        return self._apply(payload, names, request.lora_int_id)

    def release_adapter(self) -> None:
        """lora_apply="merged": the workers start restoring the bare base weights (pinned host copies back to the
        GPU on a stream of their own), which the next update merges into; sampling is refused until then. Nothing
        while asleep (a sleeping engine's weights are not on the GPU; the next update restores them first)."""
        if self.merged and not self.asleep:
            self._rpc("rollout_restore_base")

    async def _swap_lora(self, request) -> None:
        """Load `request`'s adapter, then drop the previous one; on failure restore the previous one."""
        previous = self._lora
        try:
            error = None if await self._dit_lora("add_lora", request) else "add_lora returned False"
        except Exception as e:  # noqa: BLE001 - reported below, after the previous adapter is back
            error = e
        if error is not None:
            await self._dit_lora("remove_lora", request.lora_int_id)
            shutil.rmtree(request.lora_path, ignore_errors=True)
            if previous is not None:  # with one cached adapter (the default), loading evicted it first
                await self._dit_lora("add_lora", previous)
            raise RuntimeError(f"LoRA adapter refused by vLLM-Omni; the previous adapter keeps serving: {error}")
        if previous is not None:
            await self._dit_lora("remove_lora", previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    async def _dit_lora(self, method: str, arg) -> bool:
        """`add_lora` / `remove_lora` on the diffusion stage: what AsyncOmni's methods of those names do on every
        stage (a two-stage deployment's thinker runs no adapter: the layers it would bind never run there)."""
        results = await self.omni.collective_rpc(method=method, args=(arg,), stage_ids=self._dit)
        return bool(results) and not rpc_errors(results) and all(
            all(map(bool, r)) if isinstance(r, list) else bool(r) for r in results)

    def profile_start(self, cuda: bool = True) -> None:
        """torch.profiler in the diffusion stage's workers around the requests until `profile_stop`."""
        self._rpc("rollout_profile_start", cuda)

    def profile_stop(self) -> dict:
        """The first diffusion worker's recording (jaxflow_bridge/rollout/profiling.py's `PipelineProfiler.stop`)."""
        return rpc_replies(self._rpc("rollout_profile_stop"))[0]

    # -------------------------------------------------------------------------------------- lifecycle

    def close(self) -> None:  # without it a failed request left a two-stage deployment's process waiting on its stages
        self.omni.shutdown()

    def sleep(self) -> int:
        """Level-1 sleep: the engine's weights (transformer, text encoder, VAE) move to CPU memory; returns the GPU
        bytes freed, read device-wide before and after (`gpu_memory_used`; the workers' own report where it cannot be
        read), 0 if already asleep."""
        if self.asleep:
            return 0
        if self.merged:
            self._rpc("rollout_settle")  # the base's host copies done before the weights move
        before = gpu_memory_used()
        acks = self._lifecycle("handle_sleep_task", {"task_id": uuid.uuid4().hex, "level": 1})
        self.asleep = True
        after = gpu_memory_used()
        if before is not None and after is not None:
            return max(0, before - after)
        return sum(int(a.get("freed_bytes", 0) if isinstance(a, dict) else a.freed_bytes) for a in acks)

    def wake(self) -> None:
        """Bring the weights back to the GPU."""
        if not self.asleep:
            return
        self._lifecycle("handle_wake_task", {"task_id": uuid.uuid4().hex, "tags": None})
        self.asleep = False

    def _lifecycle(self, method: str, task: dict) -> list:
        """The acknowledgements of a sleep/wake RPC; RuntimeError unless all succeeded."""
        results = self._rpc(method, task, every_stage=True)
        errors = ack_errors(results)
        if errors:
            raise RuntimeError(f"vLLM-Omni {method} failed: {errors}")
        return rpc_replies(results)

    def info(self) -> dict:
        return {"engine": self.name, "device": "cuda", "dtype": self.dtype, "policy_version": self.policy_version,
                "model": self.model_path, "fingerprint": self.fingerprint, "size_multiple": self.size_multiple,
                "lora_modules": self._lora_bound, "asleep": self.asleep,
                "quantization": self.quantization, "lora_apply": self.lora_apply, "start": self.start.to_dict(),
                "compile_cache_hits": self.compile_cache_hits}
