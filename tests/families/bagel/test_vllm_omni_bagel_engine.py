"""The vllm_omni engine's BAGEL model kind on the CPU (docs/bagel.md §7 (d)), against a stand-in vLLM-Omni 0.20
package (tests/helpers_vllm_omni.py: AsyncOmni over one in-process worker with our extension; its BAGEL pipeline
tests/helpers_vllm_omni_bagel.py): the kind read from the folder, AsyncOmni's start keywords (our pipeline class,
vLLM-Omni's single-stage deploy file by `deploy_config`), the one-stage check, the refusals, Qwen-Image's start and
requests as before, the weights fingerprint (the bagel_torch engine's), a rollout equal to the bagel_torch engine's
samples, and LoRA: the module table from BAGEL's `stacked_params_mapping`, the generation expert's seven targets on
four layers a decoder layer, slot writes under `bagel.`-prefixed names; a two-stage deployment's updates across
vLLM-Omni's msgpack."""
import dataclasses
from types import SimpleNamespace

import ml_dtypes

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from jaxflow.config import validation as config_lib
from jaxflow import families
from jaxflow.config import recipes
from jaxflow.config.errors import UserError
from jaxflow.config.validation import config_module
from jaxflow_bridge.families.bagel import keymap as bagel_keymap
from jaxflow_bridge.contract.lora import lora_pairs, read_peft
from jaxflow_bridge.contract.lora_payload import LoRAPayload
from jaxflow_bridge.contract.lora_shm import SharedAdapterFile
from jaxflow_bridge.contract.served import ServedProbe, differing
from jaxflow_bridge.contract.trajectory import TrajectoryBatch
from jaxflow_bridge.families.qwen_image import tiny
from jaxflow_bridge.families.bagel import tiny as tiny_bagel
from jaxflow_bridge.families.bagel import vllm_omni_pipeline as vob
from jaxflow_bridge.sync import vllm_omni_slots as vol
from jaxflow_bridge.engines.vllm_omni import worker
from jaxflow_bridge.families.qwen_image import vllm_omni_pipeline as vop
from jaxflow_bridge.families.bagel.sampling import BagelSamplingParams
from jaxflow_bridge.families.bagel.engine import BagelTorchEngine
from jaxflow_bridge.engines.vllm_omni.engine import VllmOmniEngine
from jaxflow_bridge.engines.vllm_omni.startup import compile_threads
from jaxflow_bridge.sync.binding import bind_lora_modules
from jaxflow_bridge.rollout.fingerprint import stored_fingerprint
from jaxflow_bridge.engines.vllm_omni.kinds import model_kind
from jaxflow_bridge.families.bagel.spec import DEPLOY_FILES
from jaxflow_bridge.families.bagel.vllm_omni_kind import VllmOmniKind as Bagel
from jaxflow_bridge.families.qwen_image.vllm_omni_kind import VllmOmniKind as QwenImage
from tests.helpers import ROOT, expected_served
from tests.helpers_vllm_omni import SAMPLING, SEEDS, FakeBagel, FakeOmniQwenImagePipeline, install_fake_vllm_omni
from tests.helpers_vllm_omni_bagel import NaiveCache, stand_in_thinker, stock_bagel_pipeline

LAYERS, TARGETS = tiny_bagel.TINY_LLM["num_hidden_layers"], len(bagel_keymap.DEFAULT_LORA_TARGETS)
RANK, ALPHA = 4, 8.0
CONFIG = {"r": RANK, "lora_alpha": ALPHA, "target_modules": list(bagel_keymap.DEFAULT_LORA_TARGETS)}
SP = BagelSamplingParams(height=64, width=96, num_inference_steps=4, sde_window_range=(0, 3), cfg_interval=(0.8, 1.0),
                         cfg_text_scale=4.0)
PROMPT = "a red sign"
LLM = "language_model.model.layers"


@pytest.fixture(scope="module")
def folder():
    return tiny_bagel.tiny_bagel_path()  # float32: vLLM-Omni's is bf16, which no CPU test needs


@pytest.fixture(scope="module")
def bagel_torch(folder):
    return BagelTorchEngine({"engine": "bagel_torch", "model": str(folder), "decode": "preview"})


def fake_omni(monkeypatch, root, bagel_torch, stages=1, thinker=None) -> type:
    """The stand-in vLLM-Omni under `root`, its pipeline ours over the bagel_torch engine's model (two stages: the
    stand-in thinker over the same model before it); its AsyncOmni."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # what the engine exports for vLLM-Omni's workers, undone after
    pipeline = vob.build_pipeline_class(stock_bagel_pipeline(bagel_torch), SimpleNamespace, NaiveCache)
    return install_fake_vllm_omni(monkeypatch, root, {vob.PIPELINE_CLASS: pipeline}, stages,
                                  thinker or (stand_in_thinker(bagel_torch) if stages == 2 else None))


def start(monkeypatch, root, bagel_torch, stages=1, **config):
    """The vllm_omni engine on the tiny BAGEL folder, vLLM-Omni stood in for (`fake_omni`); (engine, AsyncOmni)."""
    omni = fake_omni(monkeypatch, root, bagel_torch, stages)
    return VllmOmniEngine({"engine": "vllm_omni", "model": bagel_torch.model_path, **config}), omni


def adapter(folder, seed: int, prefix: str = bagel_keymap.PEFT_PREFIX) -> dict[str, np.ndarray]:
    """A random PEFT adapter on the generation expert's seven targets, BAGEL's names, shapes from the folder."""
    rng, out = np.random.default_rng(seed), {}
    with safe_open(folder / "ema.safetensors", framework="pt") as f:
        for key in sorted(k for e in bagel_keymap.lora_key_map(CONFIG["target_modules"]) for k in e.diffusers_keys(LAYERS)):
            module, part, _ = key.rsplit(".", 2)
            fan_out, fan_in = f.get_slice(f"{module}.weight").get_shape()
            shape = (RANK, fan_in) if part == "lora_A" else (fan_out, RANK)
            out[prefix + key] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
    return out


def one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------------------------------- the kind


def test_the_kind_comes_from_the_folder(folder, bagel_torch, tiny_path, tmp_path, monkeypatch):
    qwen, bagel = model_kind(str(tiny_path), "bfloat16"), model_kind(str(folder), "bfloat16")
    assert isinstance(qwen, QwenImage) and qwen.folder == tiny_path and qwen.size_multiple == 8
    assert isinstance(bagel, Bagel) and bagel.folder == folder
    assert bagel.size_multiple == bagel_torch.info()["size_multiple"] == 16
    asked = []
    monkeypatch.setattr(tiny_bagel, "tiny_bagel_path", lambda dtype: asked.append(("bagel", dtype)) or folder)
    monkeypatch.setattr(tiny, "tiny_pipeline_path", lambda dtype: asked.append(("qwen", dtype)) or tiny_path)
    assert isinstance(model_kind("tiny_bagel", "bfloat16"), Bagel) and isinstance(model_kind("tiny", "bfloat16"),
                                                                                   QwenImage)
    assert asked == [("bagel", "bfloat16"), ("qwen", "bfloat16")]  # the tiny folders saved in the engine's dtype
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(ValueError, match="neither a diffusers Qwen-Image folder .* nor a BAGEL folder") as err:
        model_kind(str(tmp_path), "bfloat16")
    one_line(err)


def test_the_fingerprint_is_the_bagel_torch_engines_over_the_trainers_tensors(folder, bagel_torch, tmp_path):
    """ema.safetensors' first elements without the prefixes the trainer ignores: the bagel_torch engine's value (and
    so the trainer's, tests/families/bagel/test_bagel_train.py); a changed ViT tensor leaves it, a changed expert weight moves it."""
    assert Bagel(folder).fingerprint() == bagel_torch.info()["fingerprint"]
    (tmp_path / "config.json").write_bytes((folder / "config.json").read_bytes())
    tensors = load_file(folder / "ema.safetensors")
    vit = next(k for k in tensors if k.startswith("vit_model."))
    expert = f"{LLM}.1.mlp_moe_gen.down_proj.weight"
    for key, same in ((vit, True), (expert, False)):
        changed = dict(tensors, **{key: tensors[key].clone()})
        changed[key].view(-1)[0] += 1.0
        save_file(changed, tmp_path / "ema.safetensors")
        assert (Bagel(tmp_path).fingerprint() == bagel_torch.info()["fingerprint"]) is same, key


# ---------------------------------------------------------------------------------------------- the start


def test_bagel_starts_our_pipeline_in_vllm_omnis_single_stage_deployment(folder, bagel_torch, tmp_path, monkeypatch):
    engine, omni = start(monkeypatch, tmp_path, bagel_torch)
    (started,) = omni.started
    deploy = tmp_path / "vllm_omni" / "deploy" / "bagel_single_stage.yaml"  # vLLM-Omni 0.20's wheel layout
    assert started.model == str(folder) and DEPLOY_FILES["single_stage"] == ("deploy", "bagel_single_stage.yaml")
    assert started.kwargs == {"custom_pipeline_args": {"pipeline_class": vob.PIPELINE_CLASS,
                                                       "compile_threads": compile_threads()},
                              "deploy_config": str(deploy), "worker_extension_cls": worker.WORKER_EXTENSION_CLASS,
                              "dtype": "bfloat16", "enable_sleep_mode": True}
    info = engine.info()
    assert info["fingerprint"] == bagel_torch.info()["fingerprint"] and info["size_multiple"] == 16
    assert info["model"] == str(folder) and not engine.merged


def test_a_missing_deploy_file_or_a_second_stage_is_refused_in_one_line(bagel_torch, tmp_path, monkeypatch):
    two = fake_omni(monkeypatch, tmp_path / "two", bagel_torch, stages=2)
    with pytest.raises(RuntimeError, match=r"vLLM-Omni started 2 stages .* expected 1 \(BAGEL: ") as err:
        VllmOmniEngine({"engine": "vllm_omni", "model": bagel_torch.model_path})
    one_line(err)
    assert two.started[0].stopped  # shut down, not left holding the GPU
    omni = fake_omni(monkeypatch, tmp_path / "old", bagel_torch)
    (tmp_path / "old" / "vllm_omni" / "deploy" / "bagel_single_stage.yaml").unlink()
    with pytest.raises(FileNotFoundError, match="bagel_single_stage.yaml is missing: BAGEL.s deploy=") as err:
        VllmOmniEngine({"engine": "vllm_omni", "model": bagel_torch.model_path})
    one_line(err)
    assert omni.started == []


@pytest.mark.parametrize("option, needle", [
    ({"qk_ops": "vllm"}, "qk_ops configure"), ({"fa_version": "2"}, "fa_version configure"),
    ({"gelu": "separate", "cfg_forward": "split"}, "gelu, cfg_forward configure"),
    ({"lora_apply": "layers"}, "lora_apply='layers' is Qwen-Image's"),
    ({"lora_apply": "merged"}, "pass lora_apply='folder'"), ({"random_seed": 3}, "model.init='checkpoint'")])
def test_what_bagel_lacks_is_refused_in_one_line_before_the_start(bagel_torch, tmp_path, monkeypatch, option, needle):
    omni = fake_omni(monkeypatch, tmp_path, bagel_torch)
    with pytest.raises(ValueError, match=needle) as err:
        VllmOmniEngine({"engine": "vllm_omni", "model": bagel_torch.model_path, **option})
    one_line(err)
    assert omni.started == []


def test_lora_apply_folder_is_bagels_own(bagel_torch, tmp_path, monkeypatch):
    engine, omni = start(monkeypatch, tmp_path, bagel_torch, lora_apply="folder")
    assert omni.started[0].kwargs["custom_pipeline_args"] == {"pipeline_class": vob.PIPELINE_CLASS,
                                                              "compile_threads": compile_threads()}


def test_qwen_image_starts_and_asks_as_before(tiny_path, tmp_path, monkeypatch):
    """The Qwen-Image kind: the start keywords and every request exactly what the engine sent before BAGEL (its
    pipeline's options at their defaults, no deploy file; vllm_omni_pipeline.encode_request's requests)."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pipeline = vop.build_pipeline_class(FakeOmniQwenImagePipeline, SimpleNamespace)
    omni = install_fake_vllm_omni(monkeypatch, tmp_path, {vop.PIPELINE_CLASS: pipeline})
    engine = VllmOmniEngine({"engine": "vllm_omni", "model": str(tiny_path)})
    (started,) = omni.started
    assert started.kwargs == {"custom_pipeline_args": {"pipeline_class": vop.PIPELINE_CLASS, "lora_apply": "layers",
                                                       "qk_ops": "compiled", "fa_version": "auto",
                                                       "cfg_forward": "split", "gelu": "epilogue",
                                                       "compile_threads": compile_threads()},
                              "worker_extension_cls": worker.WORKER_EXTENSION_CLASS, "dtype": "bfloat16",
                              "enable_sleep_mode": True}
    assert engine.info()["fingerprint"] == stored_fingerprint(tiny_path / "transformer") and engine.merged is False
    out = TrajectoryBatch.from_dict(engine.generate(["a red fox"], 2, dataclasses.asdict(SAMPLING), seeds=SEEDS))
    (prompt, params), = started.requests
    want_prompt, want_kwargs = vop.encode_request("a red fox", SAMPLING, SEEDS, 0)
    assert prompt == want_prompt and vars(params) == {**want_kwargs, "lora_request": None}
    assert len(out) == 2 and list(out.seeds) == SEEDS


# ---------------------------------------------------------------------------------------------- rollout


@pytest.mark.parametrize("think", [False, True], ids=["plain", "think"])
def test_a_rollout_is_the_bagel_torch_engines_samples(bagel_torch, tmp_path, monkeypatch, think):
    """BagelSamplingParams through the BAGEL request codec to our pipeline (N + 1 schedule points asked), each sample
    the bagel_torch engine's alone, byte for byte (the stand-in runs that engine's model); in think mode the stock
    forward's think keys sent (greedy) and the decoded tokens in `prompt_ids`."""
    sp = dataclasses.replace(SP, think=think, max_think_tokens=40)
    engine, omni = start(monkeypatch, tmp_path, bagel_torch)
    out = TrajectoryBatch.from_dict(engine.generate([PROMPT], 2, dataclasses.asdict(sp), seeds=[21, 22]))
    (prompt, params), = omni.started[0].requests
    assert prompt == {"prompt": PROMPT} and params.num_inference_steps == SP.num_inference_steps + 1
    assert params.extra_args["seeds"] == [21, 22] and params.lora_request is None
    assert (params.extra_args["think"], params.extra_args["max_think_tokens"], params.extra_args["do_sample"]) == (
        think, 40, False)
    for j, seed in enumerate([21, 22]):
        alone = TrajectoryBatch.from_dict(bagel_torch.generate([PROMPT], 1, dataclasses.asdict(sp), seeds=[seed]))
        for field in ("images", "latents", "log_probs", "sigmas", "step_index", "prompt_ids", "prompt_mask",
                      "negative_prompt_ids", "seeds"):
            got, want = getattr(out, field), getattr(alone, field)
            np.testing.assert_array_equal(got if field == "sigmas" else got[j:j + 1], want, err_msg=field)
    with pytest.raises(ValueError, match="unknown"):  # BagelSamplingParams, not Qwen-Image's
        engine.generate([PROMPT], 2, {"true_cfg_scale": 4.0})


# ---------------------------------------------------------------------------------------------- two stages


def test_two_stages_start_the_thinker_and_our_pipeline_on_the_dit_stage(folder, bagel_torch, tmp_path, monkeypatch):
    """deploy="two_stage": vLLM-Omni's `bagel.yaml` (thinker, then DiT), our pipeline and extension by the DiT
    stage's `stage_1_*` keywords (the thinker stays vLLM-Omni's), worker RPCs to that stage alone."""
    engine, omni = start(monkeypatch, tmp_path, bagel_torch, stages=2, deploy="two_stage")
    (started,) = omni.started
    assert started.kwargs == {"stage_1_custom_pipeline_args": {"pipeline_class": vob.PIPELINE_CLASS,
                                                               "compile_threads": compile_threads()},
                              "deploy_config": str(tmp_path / "vllm_omni" / "deploy" / "bagel.yaml"),
                              "stage_1_worker_extension_cls": worker.WORKER_EXTENSION_CLASS,
                              "dtype": "bfloat16", "enable_sleep_mode": True}
    assert started.rpcs == [("rollout_lora_modules", [1])] and engine.info()["lora_modules"] == 0
    one = fake_omni(monkeypatch, tmp_path / "one", bagel_torch)  # a one-stage start where two were asked
    with pytest.raises(RuntimeError, match="started 1 stages .* expected 2") as err:
        VllmOmniEngine({"engine": "vllm_omni", "model": bagel_torch.model_path, "deploy": "two_stage"})
    one_line(err)
    assert one.started[0].stopped


def test_a_two_stage_rollout_is_the_single_stages(folder, bagel_torch, tmp_path, monkeypatch):
    """The thinker prefills the framed prompt (one greedy token asked) and its KV replaces our prefill: every
    sample equal to the single-stage engine's byte for byte, with and without a LoRA, which binds on the DiT stage
    alone; the ids the thinker reports are the trajectory's."""
    sp = dataclasses.asdict(dataclasses.replace(SP, text_tokens=(64, 64)))  # joined calls: one text length
    single, _ = start(monkeypatch, tmp_path / "single", bagel_torch)
    engine, omni = start(monkeypatch, tmp_path / "two", bagel_torch, stages=2, deploy="two_stage")
    started = omni.started[-1]
    for version in (0, 1):
        if version:
            for e in (single, engine):
                assert e.update_lora(adapter(folder, 5), 1, CONFIG)["bound_modules"] == LAYERS * TARGETS
            assert started.rpcs[-2:] == [("add_lora", [1]), ("rollout_apply_lora", [1])]  # loaded, read back
        want = TrajectoryBatch.from_dict(single.generate([PROMPT, "a fox"], 2, sp, seeds=[3, 4, 5, 6]))
        got = TrajectoryBatch.from_dict(engine.generate([PROMPT, "a fox"], 2, sp, seeds=[3, 4, 5, 6]))
        for field in ("images", "latents", "log_probs", "sigmas", "step_index", "prompt_ids", "prompt_mask",
                      "negative_prompt_ids", "seeds", "policy_versions"):
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    prompt, thinker = started.thinker_requests[0]
    assert prompt == {"prompt": f"<|im_start|>{PROMPT}<|im_end|>"} and vars(thinker) == {"max_tokens": 1,
                                                                                         "temperature": 0.0}
    assert started.requests[0][1].extra_args["framed"] and started.requests[-1][1].lora_request is not None
    assert all(stages == [1] for method, stages in started.rpcs)  # nothing asked of the thinker


def test_two_stages_refuse_think_and_a_thinker_that_fed_other_ids(bagel_torch, tmp_path, monkeypatch):
    engine, _ = start(monkeypatch, tmp_path / "a", bagel_torch, stages=2, deploy="two_stage")
    with pytest.raises(ValueError, match="think mode runs in the single-stage deployment only") as err:
        engine.generate([PROMPT], 2, dataclasses.asdict(dataclasses.replace(SP, think=True)), seeds=[1, 2])
    one_line(err)
    real = stand_in_thinker(bagel_torch)

    def short(text):  # the closing <|im_end|> not prefilled
        ids, kv, rope = real(text)
        return ids[:-1], SimpleNamespace(key_cache=[k[:-1] for k in kv.key_cache],
                                         value_cache=[v[:-1] for v in kv.value_cache]), rope - 1

    def other(text):  # as many ids, other ones
        ids, kv, rope = real(text)
        return [ids[0], *reversed(ids[1:-1]), ids[-1]], kv, rope

    for name, thinker, error, needle in (("short", short, RuntimeError, "the thinker sent 7 context tokens"),
                                         ("other", other, ValueError, "thinker prefilled 8 ids for 'a red sign'")):
        omni = fake_omni(monkeypatch, tmp_path / name, bagel_torch, 2, thinker)
        engine = VllmOmniEngine({"engine": "vllm_omni", "model": bagel_torch.model_path, "deploy": "two_stage"})
        with pytest.raises(error, match=needle):
            engine.generate([PROMPT], 2, dataclasses.asdict(SP), seeds=[1, 2])
        assert omni.started


def test_a_deploy_is_bagels_own(tiny_path, bagel_torch, tmp_path, monkeypatch):
    omni = fake_omni(monkeypatch, tmp_path, bagel_torch)
    for model, deploy, needle in ((str(tiny_path), "two_stage", "Qwen-Image runs one stage: drop it"),
                                  (bagel_torch.model_path, "bagel_think", "BAGEL runs one of")):
        with pytest.raises(ValueError, match=needle) as err:
            VllmOmniEngine({"engine": "vllm_omni", "model": model, "deploy": deploy})
        one_line(err)
    assert omni.started == []


# ---------------------------------------------------------------------------------------------- LoRA


def test_the_lora_table_comes_from_bagels_stacked_params_mapping():
    """Qwen2MoTForCausalLM has no packed_modules_mapping: the fused slices come from the `stacked_params_mapping` its
    load_weights sets, in slot order; vLLM's linears are listed with their slices, plain nn.Linear are not."""
    table = vol.lora_module_table(FakeBagel())
    assert table["packed"] == {"qkv_proj_moe_gen": ["q_proj_moe_gen", "k_proj_moe_gen", "v_proj_moe_gen"],
                               "qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    modules = table["modules"]
    for g in ("", "_moe_gen"):
        assert modules[f"{LLM}.1.self_attn.qkv_proj{g}"] == [64, [64, 32, 32]]
        assert modules[f"{LLM}.1.self_attn.o_proj{g}"] == [64, [64]]
        assert modules[f"{LLM}.1.mlp{g}.gate_up_proj"] == [64, [128, 128]]
        assert modules[f"{LLM}.1.mlp{g}.down_proj"] == [128, [64]]
    assert len(modules) == 8 * LAYERS + 2 and modules["connector.fc1"] == [32, [64]]
    assert not {"language_model.lm_head", "vae2llm", "llm2vae"} & set(modules)
    assert vol.lora_module_table(FakeBagel(stacked=False))["packed"] == {}


def test_the_generation_experts_seven_targets_bind_four_layers_a_decoder_layer(folder):
    pairs = lora_pairs(Bagel(folder).adapter(adapter(folder, 1)))  # the PEFT prefix dropped
    assert len(pairs) == TARGETS * LAYERS and all(m.startswith(LLM) for m in pairs)
    bound = bind_lora_modules(pairs, RANK, vol.lora_module_table(FakeBagel()))
    layers = {layer for layer, _ in bound.values()}
    assert len(layers) == 4 * LAYERS and all("_moe_gen" in layer for layer in layers)
    for leaf, layer, slot in (("self_attn.q_proj_moe_gen", "self_attn.qkv_proj_moe_gen", 0),
                              ("self_attn.v_proj_moe_gen", "self_attn.qkv_proj_moe_gen", 2),
                              ("mlp_moe_gen.gate_proj", "mlp_moe_gen.gate_up_proj", 0),
                              ("mlp_moe_gen.up_proj", "mlp_moe_gen.gate_up_proj", 1),
                              ("self_attn.o_proj_moe_gen", "self_attn.o_proj_moe_gen", None),
                              ("mlp_moe_gen.down_proj", "mlp_moe_gen.down_proj", None)):
        assert bound[f"{LLM}.1.{leaf}"] == (f"{LLM}.1.{layer}", slot), leaf
    with pytest.raises(ValueError, match=r"q_proj_moe_gen: the engine transformer has no such"):  # no slices known
        bind_lora_modules(pairs, RANK, vol.lora_module_table(FakeBagel(stacked=False)))
    und = {f"{LLM}.0.mlp.gate_proj.lora_{p}.weight": np.zeros((RANK, 64) if p == "A" else (128, RANK), np.float32)
           for p in "AB"}
    with pytest.raises(ValueError, match=r"2 tensors off the generation expert.*layers\.0\.mlp\.gate_proj\.lora_A") as err:
        Bagel(folder).adapter(und)
    one_line(err)


def test_lora_updates_reach_the_bagel_slots(folder, bagel_torch, tmp_path, monkeypatch):
    """update_lora: the adapter checked against the table, written as a PEFT folder in BAGEL's names and loaded;
    update_lora_shared: the next one written in place into the `bagel.`-prefixed layers' slots (B times alpha / r),
    the understanding expert's untouched; an off-expert adapter refused, the served one kept."""
    engine, omni = start(monkeypatch, tmp_path, bagel_torch)
    first = LoRAPayload(1, CONFIG, adapter(folder, 1))
    reply = engine.update_lora(first.tensors, 1, CONFIG)
    assert reply["bound_modules"] == TARGETS * LAYERS
    served = ServedProbe.from_dict(reply["served"])  # read back from the slots, under the trainer's PEFT names
    assert all(m.startswith(bagel_keymap.PEFT_PREFIX) for m in served.deltas)
    assert differing(expected_served(first), served) == []
    (request,) = omni.started[0].loaded
    tensors, config = read_peft(request.lora_path)
    assert sorted(tensors) == sorted(k.removeprefix(bagel_keymap.PEFT_PREFIX) for k in adapter(folder, 1))
    assert config["r"] == RANK and config["target_modules"] == CONFIG["target_modules"]
    second = adapter(folder, 2, prefix="")  # the trainer's shared file: lora_to_peft's names
    shared = SharedAdapterFile("bfloat16", root=tmp_path)
    payload = LoRAPayload(2, CONFIG, shared=shared.write_arrays(second))
    reply = engine.update_lora_shared(payload.shared, 2, CONFIG)
    assert reply["bound_modules"] == TARGETS * LAYERS and len(omni.started[0].loaded) == 1  # in place, no new folder
    assert differing(expected_served(payload), ServedProbe.from_dict(reply["served"])) == []
    assert differing(expected_served(first), ServedProbe.from_dict(reply["served"])) != []
    slots = omni.started[0].worker.lora_manager._lora_modules
    gate_up = slots[f"bagel.{LLM}.1.mlp_moe_gen.gate_up_proj"]
    up = f"{LLM}.1.mlp_moe_gen.up_proj.lora_"
    bf16 = lambda key: torch.from_numpy(second[key]).to(torch.bfloat16)  # noqa: E731
    assert torch.equal(gate_up.lora_a_stacked[1][0, 0], bf16(up + "A.weight"))
    assert torch.equal(gate_up.lora_b_stacked[1][0, 0], bf16(up + "B.weight") * (ALPHA / RANK))
    und = slots[f"bagel.{LLM}.1.mlp.gate_up_proj"]
    assert not any(t.any() for t in (*und.lora_a_stacked, *und.lora_b_stacked))
    off = {k.replace("q_proj_moe_gen", "q_proj"): v for k, v in adapter(folder, 3).items()}
    with pytest.raises(ValueError, match="off the generation expert; the previous adapter keeps serving") as err:
        engine.update_lora(off, 3, CONFIG)
    one_line(err)
    assert engine.info()["policy_version"] == 2 and len(omni.started[0].loaded) == 1


@pytest.mark.parametrize("change, needle", [
    ({"rollout.bagel_deploy": "three"}, "config.rollout.bagel_deploy: 'three'; choose one of ('single_stage', "),
    ({"rollout.bagel_deploy": "two_stage", "rollout.engine": "bagel_torch", "rollout.dtype": "float32",
      "rollout.device": "cpu"},
     "config.rollout.bagel_deploy: 'two_stage' is vLLM-Omni's BAGEL topology; with model.family='bagel' and "
     "rollout.engine='bagel_torch' leave it 'single_stage'"),
    ({"rollout.bagel_deploy": "two_stage", "sample.think": True},
     "config.rollout.bagel_deploy: 'two_stage' has no think mode yet"),
    ({"rollout.bagel_deploy": "two_stage", "model.family": "qwen_image"}, "with model.family='qwen_image'"),
    ({"rollout.thinker_memory": 0.25}, "config.rollout.thinker_memory: 0.25: the two-stage thinker's share"),
    ({"rollout.bagel_deploy": "two_stage", "rollout.thinker_memory": 1.0}, "in (0, 1) with rollout.bagel_deploy")])
def test_the_config_takes_bagels_deploy_on_vllm_omni_alone(change, needle):
    """rollout.bagel_deploy reaches the vllm_omni engine as `deploy` (two stages validate there), rollout.thinker_memory
    as the thinker's `stage_0_gpu_memory_utilization`; a bad value, another engine or family, two stages with think
    mode, or a thinker share without a thinker fail in one line."""
    cfg = config_module(ROOT / "configs" / "tiny_bagel_ocr.py").get_config()
    cfg.data.train, cfg.data.test = str(ROOT / cfg.data.train), str(ROOT / cfg.data.test)
    cfg.rollout.update(engine="vllm_omni", dtype="bfloat16", device="cuda")
    assert "rollout.bagel_deploy" in recipes.HELP and cfg.rollout.bagel_deploy == "single_stage"
    assert families.of(cfg).engine_config(cfg) == {"deploy": "single_stage"}
    cfg.rollout.bagel_deploy = "two_stage"
    config_lib.validate(cfg)
    assert families.of(cfg).engine_config(cfg) == {"deploy": "two_stage"}
    cfg.rollout.thinker_memory = 0.25  # the thinker's share: vLLM-Omni's per-stage keyword
    config_lib.validate(cfg)
    assert families.of(cfg).engine_config(cfg) == {"deploy": "two_stage",
                                                   "omni_args": {"stage_0_gpu_memory_utilization": 0.25}}
    cfg.rollout.update(bagel_deploy="single_stage", thinker_memory=0.0)
    for key, value in change.items():
        section, name = key.split(".")
        cfg[section][name] = value
    if cfg.model.family == "qwen_image":
        cfg.model.path = "tiny"
    with pytest.raises(UserError) as err:
        config_lib.validate(cfg)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_failed_in_place_write_is_logged_counted_and_never_a_lasting_switch(folder, bagel_torch, tmp_path,
                                                                           monkeypatch, caplog):
    """The workers' in-place write failing (the slots not where this vLLM-Omni keeps them) is one logged line naming
    the engine and version and a count in the reply ("fallbacks"); that update loads a folder instead and serves it
    (the reply's probe says so); the next update goes in place again (it once switched to folders for good, silently
    but for one warning)."""
    import logging

    engine, omni = start(monkeypatch, tmp_path, bagel_torch)
    assert engine.update_lora(adapter(folder, 1), 1, CONFIG)["fallbacks"] == 0
    shared = SharedAdapterFile("bfloat16", root=tmp_path)
    failing = lambda *args: (_ for _ in ()).throw(RuntimeError("no wrapped layer"))  # noqa: E731
    with monkeypatch.context() as m, caplog.at_level(logging.ERROR):
        m.setattr(vol, "write_lora_slots", failing)
        second = LoRAPayload(2, CONFIG, shared=shared.write_arrays(adapter(folder, 2, prefix="")))
        reply = engine.update_lora_shared(second.shared, 2, CONFIG)
    line = [r.getMessage() for r in caplog.records if "in-place" in r.getMessage()][0]
    assert line.startswith("vllm_omni engine: in-place LoRA write of version 2 failed (1 so far)") and "\n" not in line
    assert reply["fallbacks"] == 1 and len(omni.started[0].loaded) == 2  # this update loaded a folder
    assert engine.info()["policy_version"] == 2 and differing(expected_served(second), ServedProbe.from_dict(reply["served"])) == []
    reply = engine.update_lora_shared(shared.write_arrays(adapter(folder, 3, prefix="")), 3, CONFIG)
    assert reply["fallbacks"] == 1 and len(omni.started[0].loaded) == 2  # in place again


def test_two_stage_lora_updates_cross_vllm_omnis_msgpack(folder, bagel_torch, tmp_path, monkeypatch):
    """Between a two-stage deployment's processes vLLM-Omni 0.20 sends worker RPCs through msgpack (the stand-in does
    too): bfloat16 arrays, which it refuses raw, and a shared file's manifest both reach the DiT stage's slots and are
    read back; an add_lora its stage client answers with an error dict (the DiT process raised) is a refused adapter,
    the previous one kept."""
    engine, omni = start(monkeypatch, tmp_path, bagel_torch, stages=2, deploy="two_stage")
    started = omni.started[-1]
    first = LoRAPayload(1, CONFIG, {k: v.astype(ml_dtypes.bfloat16) for k, v in adapter(folder, 1).items()})
    reply = engine.update_lora(first.tensors, 1, CONFIG)
    assert reply["bound_modules"] == LAYERS * TARGETS
    assert differing(expected_served(first), ServedProbe.from_dict(reply["served"])) == []
    shared = SharedAdapterFile("bfloat16", root=tmp_path)
    second = LoRAPayload(2, CONFIG, shared=shared.write_arrays(adapter(folder, 2, prefix="")))
    reply = engine.update_lora_shared(second.shared, 2, CONFIG)
    assert len(started.loaded) == 1 and started.rpcs[-1] == ("rollout_apply_lora", [1])  # in place
    assert differing(expected_served(second), ServedProbe.from_dict(reply["served"])) == []
    add_lora = started._add_lora
    monkeypatch.setattr(started, "_add_lora", lambda request: {"error": True, "reason": "ValueError: no such layer"}
                        if request is not started.loaded[0] else add_lora(request))
    with pytest.raises(RuntimeError, match="refused by vLLM-Omni; the previous adapter keeps serving"):
        engine.update_lora(adapter(folder, 3), 3, dict(CONFIG, lora_alpha=2 * ALPHA))  # a new config: add_lora
    assert engine.info()["policy_version"] == 2 and started.loaded[-1] is started.loaded[0]  # loaded again
    shared.close()
