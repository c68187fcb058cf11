"""The vllm_omni engine's CPU-testable parts (no vLLM-Omni here): request split, output unpacking, the custom
pipeline on diffusers components, LoRA binding against a fused transformer, fingerprint, selection errors."""
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from jaxflow_bridge.contract.lora import lora_pairs, to_vllm_omni
from jaxflow_bridge.sync import vllm_omni_slots as vol
from jaxflow_bridge.engines.vllm_omni import codec, gpu_memory
from jaxflow_bridge.families.qwen_image import vllm_omni_pipeline as vop
from jaxflow_bridge.engines.vllm_omni.imports import INSTALL_HINT
from jaxflow_bridge.engines.vllm_omni.rpc import ack_errors, rpc_errors
from jaxflow_bridge.sync.binding import check_lora_binding
from jaxflow_bridge.families.qwen_image.diffusers_pipeline import RolloutPipeline
from jaxflow_bridge.rollout.fingerprint import stored_fingerprint
from jaxflow_bridge.rollout.server import engine_class
from tests.helpers import LAYERS, MLP, RANK, D, random_peft
from tests.helpers_vllm_omni import (
    SAMPLING,
    SEEDS,
    FakeDiffusionOutput,
    FakeFusedTransformer,
    FakeOmniQwenImagePipeline,
    assert_batches_equal,
    omni_params,
    synthetic_batch,
    warmup_request,
)

# ---------------------------------------------------------------------------------------------- request codec


def test_sampling_split_and_round_trip():
    prompt, kwargs = vop.encode_request("a red fox", SAMPLING, SEEDS, policy_version=7)
    assert prompt == {"prompt": "a red fox", "negative_prompt": " "}
    assert set(kwargs) == {"height", "width", "num_inference_steps", "true_cfg_scale", "seed",
                           "max_sequence_length", "num_outputs_per_prompt", "extra_args"}
    assert kwargs["num_outputs_per_prompt"] == 2 and kwargs["height"] == 16 and kwargs["true_cfg_scale"] == 4.0
    assert kwargs["extra_args"] == {"noise_level": 1.2, "sde_type": "sde", "sde_window_size": 1,
                                    "sde_window_range": [0, 2], "same_latent": False, "keep_final": False,
                                    "solver": "euler", "seeds": SEEDS,
                                    "policy_version": 7}
    params = omni_params(kwargs)
    assert vop.is_rollout_request(params)
    assert vop.decode_request([prompt], params) == (["a red fox"], SAMPLING, 2, SEEDS, 7)
    shared = dataclasses.replace(SAMPLING, same_latent=True)
    _, kwargs = vop.encode_request("a red fox", shared, SEEDS, policy_version=7)
    assert vop.decode_request([prompt], omni_params(kwargs))[1] == shared
    with pytest.raises(ValueError, match="one prompt dict"):
        vop.decode_request([prompt, prompt], params)


def test_text_lengths_for_the_fused_transformer():
    """vLLM-Omni's transformer wants txt_seq_lens; our shared `velocity` passes only the mask."""
    mask = torch.tensor([[True, True, False], [True, True, True]])
    args, kwargs = vop.txt_seq_lens_from_mask(None, (), {"encoder_hidden_states_mask": mask})
    assert kwargs["txt_seq_lens"] == [2, 3] and args == ()


def test_warmup_and_plain_requests_are_not_ours():
    """vLLM-Omni's start-up dummy run sends extra_args={"cfg_text_scale": 1.0, "cfg_img_scale": 1.0}."""
    assert not vop.is_rollout_request(SimpleNamespace(extra_args={"cfg_text_scale": 1.0, "cfg_img_scale": 1.0}))
    assert not vop.is_rollout_request(SimpleNamespace(extra_args={}))


# ---------------------------------------------------------------------------------------------- output codec


@pytest.mark.parametrize("cfg, final", [(True, False), (False, False), (False, True)])
def test_output_pack_unpack(cfg, final):
    batch = synthetic_batch(cfg=cfg)
    if final:  # keep_final (DiffusionNFT): the final latents ride in the payload
        batch = dataclasses.replace(batch, final_latents=np.random.default_rng(1).standard_normal((3, 45, 64),
                                                                                                  np.float32))
    fields = codec.pack_trajectories(batch)
    assert fields["trajectory_latents"].dtype == torch.float32 and fields["trajectory_latents"].shape == (3, 3, 45, 64)
    assert fields["custom_output"]["rollout"]["prompt_embeds"].dtype == torch.bfloat16
    # vLLM-Omni's post-processing of `output` ((x / 2 + 0.5).clamp(0, 1), * 255, round) gives back the pixels
    pil = ((fields["output"] / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
    assert np.array_equal(pil, batch.images)
    # what AsyncOmni hands back: an OmniRequestOutput carrying the DiffusionOutput's fields
    result = SimpleNamespace(images=[], trajectory_latents=fields["trajectory_latents"],
                             trajectory_log_probs=fields["trajectory_log_probs"],
                             custom_output=fields["custom_output"], error=None)
    out = codec.unpack_trajectories(result, "a red fox", group_id=5)
    want = dataclasses.replace(batch, prompts=("a red fox",) * 3, group_ids=np.full(3, 5, np.int64))
    assert_batches_equal(out, want)


@pytest.mark.parametrize("neg_length", [None, 0, 3])
def test_output_pack_unpack_token_ids(neg_length):
    """BAGEL's batch: int32 context ids in place of the embeds (negatives absent, the empty L' = 0 context, or ids)."""
    rng = np.random.default_rng(2)
    ids = rng.integers(1, 384, (3, 6)).astype(np.int32)
    ids[1, 4:] = 0
    neg = {} if neg_length is None else dict(
        negative_prompt_ids=rng.integers(1, 384, (3, neg_length)).astype(np.int32),
        negative_prompt_mask=np.ones((3, neg_length), bool))
    batch = dataclasses.replace(synthetic_batch(cfg=False), prompt_embeds=None, prompt_ids=ids, **neg)
    fields = codec.pack_trajectories(batch)
    payload = fields["custom_output"]["rollout"]
    assert payload["prompt_ids"].dtype == torch.int32 and "prompt_embeds" not in payload
    assert ("negative_prompt_ids" in payload) == (neg_length is not None)
    for t in (*payload.values(), fields["trajectory_latents"], fields["trajectory_log_probs"]):
        t.view(torch.uint8)  # how vLLM-Omni serializes a stage's output (an empty L' = 0 included)
    result = SimpleNamespace(images=[], trajectory_latents=fields["trajectory_latents"],
                             trajectory_log_probs=fields["trajectory_log_probs"],
                             custom_output=fields["custom_output"], error=None)
    out = codec.unpack_trajectories(result, "a red fox", group_id=2)
    assert out.text_kind == "ids" and out.guided == (neg_length is not None)
    assert_batches_equal(out, dataclasses.replace(batch, prompts=("a red fox",) * 3, group_ids=np.full(3, 2, np.int64)))


def test_unpack_without_payload_names_the_pipeline():
    result = SimpleNamespace(trajectory_latents=None, trajectory_log_probs=None, custom_output={}, error="boom")
    with pytest.raises(ValueError, match="FlowGRPOQwenImagePipeline"):
        codec.unpack_trajectories(result, "p", 0)


# ---------------------------------------------------------------------------------------------- the pipeline


def test_custom_pipeline_matches_rollout_pipeline(tiny_path):
    """The class vLLM-Omni would build runs RolloutPipeline's loop: same trajectory, bit for bit."""
    cls = vop.build_pipeline_class(FakeOmniQwenImagePipeline, SimpleNamespace)
    assert cls.__module__ == vop.__name__ and cls.__qualname__ == "FlowGRPOQwenImagePipeline"
    ours = cls(od_config=SimpleNamespace(model=str(tiny_path)))
    prompt, kwargs = vop.encode_request("a red fox jumping", SAMPLING, SEEDS, policy_version=3)
    with torch.inference_mode():
        result = ours.forward(SimpleNamespace(prompts=[prompt], sampling_params=omni_params(kwargs)))
        stock = ours.forward(SimpleNamespace(prompts=["dummy run"], sampling_params=SimpleNamespace(extra_args={})))
    assert stock == "stock pipeline"
    got = codec.unpack_trajectories(result, "a red fox jumping", group_id=0)
    ref = RolloutPipeline.from_pretrained(tiny_path, dtype="float32", device="cpu")
    ref.policy_version = 3
    assert_batches_equal(got, ref.generate(["a red fox jumping"], 2, SAMPLING, SEEDS))
    assert ours.dtype == torch.float32 and ours.size_multiple == ref.size_multiple


def test_the_start_up_warm_up_is_answered_empty_without_running_the_model(tiny_path, monkeypatch):
    """vLLM-Omni's engine start sends one warm-up request (`DiffusionEngine._dummy_run`, which reads only the result's
    `error`): ours answers it with an empty DiffusionOutput, the stock forward, text encoder, transformer and VAE
    never called; the same request under another id runs the stock pipeline, a rollout request our loop."""
    stock = []
    monkeypatch.setattr(FakeOmniQwenImagePipeline, "forward", lambda self, req: stock.append(req) or "stock pipeline")
    ours = vop.build_pipeline_class(FakeOmniQwenImagePipeline, FakeDiffusionOutput)(
        od_config=SimpleNamespace(model=str(tiny_path)))
    ran = []
    for name, module in (("text_encoder", ours.text_encoder), ("transformer", ours.transformer),
                         ("vae", ours.vae.decoder)):
        module.register_forward_hook(lambda *_, name=name: ran.append(name))
    with torch.inference_mode():
        answer = ours.forward(warmup_request())
        assert answer == FakeDiffusionOutput() and answer.error is None and stock == [] and ran == []
        plain = warmup_request()
        plain.request_ids = ["a-plain-request"]
        assert ours.forward(plain) == "stock pipeline" and stock == [plain]
        prompt, kwargs = vop.encode_request("a red fox jumping", SAMPLING, SEEDS[:1], policy_version=0)
        result = ours.forward(SimpleNamespace(prompts=[prompt], sampling_params=omni_params(kwargs),
                                              request_ids=["rollout-0-0"]))
    assert codec.unpack_trajectories(result, "a red fox jumping", 0).latents.shape[0] == 1
    assert {"text_encoder", "transformer", "vae"} <= set(ran) and len(stock) == 1


def test_random_init_draws_the_shared_weights_without_reading_the_folder(tiny_path):
    """model.init=random with vLLM-Omni: load_weights ignores the folder's tensors and loads the spec's, every
    parameter, and reports the fingerprint the diffusers engine (and so the trainer) has for the same seed."""
    cls = vop.build_pipeline_class(FakeOmniQwenImagePipeline, SimpleNamespace)
    ours = cls(od_config=SimpleNamespace(model=str(tiny_path), custom_pipeline_args={"random_seed": 3}))

    def folder_weights():
        raise AssertionError("the folder's weights were read")
        yield

    loaded = ours.load_weights(folder_weights())
    ref = RolloutPipeline.from_pretrained(tiny_path, dtype="float32", device="cpu", random_seed=3)
    names = {f"transformer.{k}" for k, _ in ref.transformer.named_parameters()}
    assert loaded == names
    for (k, a), (_, b) in zip(ours.transformer.state_dict().items(), ref.transformer.state_dict().items()):
        assert torch.equal(a, b), k
    assert ours.random_fingerprint == ref.fingerprint != stored_fingerprint(tiny_path / "transformer")
    plain = cls(od_config=SimpleNamespace(model=str(tiny_path), custom_pipeline_args={"pipeline_class": "x"}))
    assert plain.load_weights(iter([])) == set() and plain.random_fingerprint is None


# ---------------------------------------------------------------------------------------------- LoRA binding


def test_lora_module_table():
    table = vol.lora_module_table(FakeFusedTransformer(kv=4))
    assert table["packed"] == FakeFusedTransformer.packed_modules_mapping
    modules = table["modules"]
    assert modules["transformer_blocks.0.attn.to_qkv"] == [D, [D, 4, 4]]
    assert modules["transformer_blocks.2.attn.to_out"] == [D, [D]]
    assert modules["transformer_blocks.1.img_mlp.net.0.proj"] == [D, [MLP]]
    assert modules["transformer_blocks.1.txt_mlp.net.2"] == [MLP, [D]]
    assert modules["transformer_blocks.1.img_mod.1"] == [D, [6 * D]]
    assert "transformer_blocks.0.attn.norm_q" not in modules and "img_in" in modules


def test_default_targets_bind_to_the_fused_transformer():
    table = vol.lora_module_table(FakeFusedTransformer())
    tensors = random_peft()
    assert check_lora_binding(lora_pairs(to_vllm_omni(tensors)), RANK, table) == 12 * LAYERS
    with pytest.raises(ValueError, match=r"to_out\.0: the engine transformer has no such"):
        check_lora_binding(lora_pairs(tensors), RANK, table)  # PEFT names as they are: to_out.0 binds nowhere


def test_binding_checks_shapes_slots_and_emptiness():
    table = vol.lora_module_table(FakeFusedTransformer(kv=4))  # GQA-like: k and v slices narrower than q
    pairs = lora_pairs(to_vllm_omni(random_peft(targets=("to_q", "to_k", "img_mod.1"))))
    with pytest.raises(ValueError, match=r"to_k\.lora_B\.weight: expected shape \(4, 4\) \(engine layer "
                                         r"transformer_blocks\.\d\.attn\.to_qkv\), got \(8, 4\)"):
        check_lora_binding(pairs, RANK, table)
    ok = {k: v for k, v in pairs.items() if not k.endswith("to_k")}
    assert check_lora_binding(ok, RANK, table) == 2 * LAYERS
    with pytest.raises(ValueError, match=r"expected shape \(2, 8\)"):
        check_lora_binding(ok, 2, table)
    fused = {"transformer_blocks.0.attn.to_qkv": (np.zeros((RANK, D)), np.zeros((D + 8, RANK)))}
    assert check_lora_binding(fused, RANK, table) == 1  # a fused LoRA spans all slices
    fused["transformer_blocks.0.attn.to_qkv"][1][0, 0] = np.nan
    with pytest.raises(ValueError, match="finite"):
        check_lora_binding(fused, RANK, table)
    with pytest.raises(ValueError, match="binds zero modules"):
        check_lora_binding({}, RANK, table)


# ---------------------------------------------------------------------------------------------- engine pieces


def test_fingerprint_of_the_folder_matches_the_diffusers_engine(tiny_path):
    ref = RolloutPipeline.from_pretrained(tiny_path, dtype="float32", device="cpu")
    assert stored_fingerprint(tiny_path / "transformer") == ref.fingerprint


def test_sleep_wake_acknowledgements():
    assert ack_errors([[{"task_id": "t", "status": "SUCCESS"}]]) == []
    assert ack_errors([[SimpleNamespace(status="SUCCESS", error_msg=None)]]) == []
    assert "oom" in ack_errors([[{"status": "ERROR", "error_msg": "oom"}]])[0]
    assert ack_errors([[None]]) == ["no acknowledgement"]


def test_rpc_errors_are_our_workers_and_vllm_omnis_own():
    """Our workers' failure reply, and vLLM-Omni's for a stage that raised or whose serializer refused an argument
    (StagePool: {"supported": False, "error": message}) or that lacks the RPC ({"todo": True})."""
    ours, raised = {"error": True, "reason": "AttributeError: x"}, {"supported": False, "error": "TypeError: y"}
    todo = {"supported": False, "todo": True, "reason": "not implemented yet"}
    assert rpc_errors([[{"written": 3, "served": {}}], [True, None]]) == []
    assert rpc_errors([[ours], raised, todo, [{"refused": "z"}]]) == [ours, raised, todo]


def test_gpu_memory_reading(monkeypatch):
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        return SimpleNamespace(stdout="1536\n")

    monkeypatch.setattr(gpu_memory.subprocess, "run", fake_run)
    assert gpu_memory.gpu_memory_used("3,1") == 1536 * 2 ** 20 and calls[0][-2:] == ["-i", "3"]

    def missing(cmd, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(gpu_memory.subprocess, "run", missing)
    assert gpu_memory.gpu_memory_used("0") is None


def test_selecting_vllm_omni_without_it_says_how_to_install():
    if _has_vllm_omni():
        pytest.skip("vLLM-Omni is installed here")
    engine = engine_class({"engine": "vllm_omni"})
    with pytest.raises(ImportError) as err:
        engine({"engine": "vllm_omni", "model": "/nonexistent"})
    assert "pip install jaxflow[omni]" in str(err.value) and "launch/stage_vllm_omni.sh" in str(err.value)
    assert "pip install jaxflow[omni]" in INSTALL_HINT
    with pytest.raises(ImportError):
        vop.FlowGRPOQwenImagePipeline  # noqa: B018 - vLLM-Omni's loader resolves it like this
    with pytest.raises(AttributeError):
        vop.NoSuchClass  # noqa: B018


def test_engine_config_is_checked_before_anything_loads():
    engine = engine_class({"engine": "vllm_omni"})
    with pytest.raises(ValueError, match="unknown keys"):
        engine({"engine": "vllm_omni", "model": "tiny", "steps": 3})
    with pytest.raises(ValueError, match="CUDA"):
        engine({"engine": "vllm_omni", "model": "tiny", "device": "cpu"})
    with pytest.raises(ValueError, match="dtype"):
        engine({"engine": "vllm_omni", "model": "tiny", "dtype": "float16"})


def _has_vllm_omni() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm_omni") is not None


def test_custom_pipeline_installs_the_fused_lora_apply_unless_told_stock(tiny_path):
    """vLLM-Omni's diffusion LoRA layer class gets jaxflow_bridge.rollout.kernels.lora_linear's apply when our pipeline
    is built (before any LoRA layer or compiled graph exists); lora_apply="folder" leaves it alone; a typo is refused."""
    def stock(self, x, bias=None):
        return x

    for args, fused in (({}, True), ({"lora_apply": "folder"}, False)):
        layer_cls = type("LoRALayer", (), {"apply": stock})
        cls = vop.build_pipeline_class(FakeOmniQwenImagePipeline, SimpleNamespace, layer_cls)
        cls(od_config=SimpleNamespace(model=str(tiny_path), custom_pipeline_args=args))
        assert getattr(layer_cls.apply, "fused_lora", False) is fused
        assert (layer_cls.apply.stock if fused else layer_cls.apply) is stock
    with pytest.raises(ValueError, match="lora_apply='fast'"):
        cls(od_config=SimpleNamespace(model=str(tiny_path), custom_pipeline_args={"lora_apply": "fast"}))


def test_custom_pipeline_takes_cfg_forward_from_its_args(tiny_path):
    """custom_pipeline_args' cfg_forward reaches SamplingLoop ("split" when absent); a typo is refused."""
    cls = vop.build_pipeline_class(FakeOmniQwenImagePipeline, SimpleNamespace)
    for args, want in (({}, "split"), ({"cfg_forward": "batched"}, "batched")):
        assert cls(od_config=SimpleNamespace(model=str(tiny_path), custom_pipeline_args=args)).cfg_forward == want
    with pytest.raises(ValueError, match="cfg_forward='both'"):
        cls(od_config=SimpleNamespace(model=str(tiny_path), custom_pipeline_args={"cfg_forward": "both"}))


def test_custom_pipeline_refuses_an_unknown_qk_ops(tiny_path):
    """qk_ops picks the attention's q/k norm and rotary ops (jaxflow_bridge/families/qwen_image/qk_rope.py swaps them,
    tested there); a typo is refused when the pipeline is built, before any weight loads."""
    cls = vop.build_pipeline_class(FakeOmniQwenImagePipeline, SimpleNamespace)
    for qk_ops in ("compiled", "vllm"):
        cls(od_config=SimpleNamespace(model=str(tiny_path), custom_pipeline_args={"qk_ops": qk_ops}))
    with pytest.raises(ValueError, match="qk_ops='fused'"):
        cls(od_config=SimpleNamespace(model=str(tiny_path), custom_pipeline_args={"qk_ops": "fused"}))


def test_custom_pipeline_runs_the_fa3_hook_unless_told_fa2(tiny_path):
    """fa_version="auto" (the default) calls the attention hook when the pipeline is built, "2" does not; a typo is
    refused."""
    calls = []
    cls = vop.build_pipeline_class(FakeOmniQwenImagePipeline, SimpleNamespace, attention_fa3=lambda: calls.append(1))
    for args, n in (({}, 1), ({"fa_version": "2"}, 1), ({"fa_version": "auto"}, 2)):
        cls(od_config=SimpleNamespace(model=str(tiny_path), custom_pipeline_args=args))
        assert len(calls) == n
    with pytest.raises(ValueError, match="fa_version='3'"):
        cls(od_config=SimpleNamespace(model=str(tiny_path), custom_pipeline_args={"fa_version": "3"}))


def test_the_traced_request_writes_a_profile_and_the_same_trajectory(tiny_path, tmp_path, monkeypatch):
    """JAXFLOW_ROLLOUT_TRACE: the chosen request runs under torch.profiler, writes its trace, returns what an
    untraced request returns."""
    monkeypatch.setenv(vop.TRACE_ENV, str(tmp_path / "trace"))
    monkeypatch.setenv(vop.TRACE_AT_ENV, "2")
    cls = vop.build_pipeline_class(FakeOmniQwenImagePipeline, SimpleNamespace)
    ours = cls(od_config=SimpleNamespace(model=str(tiny_path)))
    prompt, kwargs = vop.encode_request("a red fox jumping", SAMPLING, SEEDS, policy_version=0)
    request = SimpleNamespace(prompts=[prompt], sampling_params=omni_params(kwargs))
    with torch.inference_mode():
        first = codec.unpack_trajectories(ours.forward(request), "a red fox jumping", 0)
        assert not (tmp_path / "trace").exists()
        second = codec.unpack_trajectories(ours.forward(request), "a red fox jumping", 0)
    assert len(list((tmp_path / "trace").glob("rollout-*-2-*s.json"))) == 1
    assert_batches_equal(first, second)


def test_update_lora_sends_arrays_through_the_engines_own_shared_file(tmp_path, monkeypatch):
    """Arrays given to `update_lora` reach the workers as a manifest of a shared file in the engine's LoRA folder,
    in their own dtype and bit for bit, never as arrays in vLLM-Omni's RPC (a full-size adapter stalled it)."""
    import ml_dtypes

    from jaxflow_bridge.contract.lora_shm import read_arrays
    from jaxflow_bridge.engines.vllm_omni.engine import VllmOmniEngine

    engine = VllmOmniEngine.__new__(VllmOmniEngine)
    engine._lora_dir, engine._lora_file, engine._lora_config = tmp_path, None, None
    served = []
    monkeypatch.setattr(engine, "serve_lora", lambda payload: served.append(payload) or {"version": payload.version})
    tensors = random_peft()
    config = {"r": RANK, "lora_alpha": 2 * RANK}
    for version, cast in ((1, np.float32), (2, ml_dtypes.bfloat16), (3, np.float32)):
        arrays = {k: v.astype(cast) for k, v in tensors.items()}
        assert engine.update_lora(arrays, version, config)["version"] == version
        payload = served[-1]
        assert payload.tensors is None and payload.shared["dtype"] == np.dtype(cast).name
        assert payload.shared["path"].startswith(str(tmp_path))
        got = read_arrays(payload.shared)
        assert sorted(got) == sorted(arrays)
        for k, v in arrays.items():
            assert got[k].dtype == v.dtype and np.array_equal(got[k].view(np.uint8), v.view(np.uint8)), k
