"""The vllm_omni engine's rules in one copy (jaxflow_bridge/engines/vllm_omni/rules.py and each family spec's
`vllm_omni_problems`): the validation stage refuses a bad combination in one line naming the key and the fix, before
Ray or torch start, and the engine refuses what it is handed through the same functions."""
from __future__ import annotations

import pytest

from jaxflow.config import validation
from jaxflow.config.errors import UserError
from jaxflow.config.validation import config_module
from jaxflow_bridge.engines.vllm_omni import engine as vllm_omni_engine
from jaxflow_bridge.engines.vllm_omni import rules
from jaxflow_bridge.families.bagel import spec as bagel_spec
from tests.helpers import ROOT, tiny_config
from tests.helpers_vllm_omni import install_fake_vllm_omni

BAGEL_OMNI = {"rollout.engine": "vllm_omni", "rollout.dtype": "bfloat16", "rollout.device": "cuda"}


def config(recipe: str, changes: dict):
    cfg = config_module(ROOT / "configs" / recipe).get_config()
    cfg.data.train, cfg.data.test = str(ROOT / cfg.data.train), str(ROOT / cfg.data.test)
    for key, value in changes.items():
        section, name = key.split(".")
        cfg[section][name] = value
    return cfg


@pytest.mark.parametrize("recipe, changes, message", [
    ("tiny_ocr.py", {"rollout.engine": "vllm_omni", "rollout.dtype": "bfloat16"},  # caught at the engine's start before
     "config.rollout.device: 'cpu': Qwen-Image runs with 'cuda' on the vllm_omni engine (the actor's CUDA GPU, which "
     "Ray gives it)"),
    ("tiny_ocr.py", {"rollout.engine": "vllm_omni", "rollout.dtype": "bfloat16", "rollout.device": "cuda:1"},
     "config.rollout.device: 'cuda:1': Qwen-Image runs with 'cuda' on the vllm_omni engine (the actor's CUDA GPU, "
     "which Ray gives it)"),
    ("tiny_ocr.py", {"rollout.engine": "vllm_omni"},
     "config.rollout.dtype: 'float32': Qwen-Image runs with 'bfloat16' on the vllm_omni engine (vLLM-Omni 0.20 runs "
     "bfloat16 only: its warm-up fails on float32 folders); use rollout.engine='diffusers' for float32"),
    ("tiny_bagel_ocr.py", {"rollout.engine": "vllm_omni"},
     "config.rollout.dtype: 'float32': BAGEL runs with 'bfloat16' on the vllm_omni engine (vLLM-Omni 0.20 runs "
     "bfloat16 only: its warm-up fails on float32 folders); use rollout.engine='bagel_torch' for float32"),
    ("tiny_bagel_ocr.py", {**BAGEL_OMNI, "model.init": "random"},
     "config.model.init: 'random': BAGEL runs with 'checkpoint' on the vllm_omni engine (vLLM-Omni's BAGEL has no "
     "random-weight path; bagel_torch has): use model.init='checkpoint', or the bagel_torch engine for "
     "model.init='random'"),
    ("tiny_bagel_ocr.py", {**BAGEL_OMNI, "rollout.lora_apply": "merged"},
     "config.rollout.lora_apply: 'merged': BAGEL runs with 'auto' or 'folder' on the vllm_omni engine (its one LoRA "
     "mode there) for now (docs/bagel.md §7)"),
    ("tiny_bagel_ocr.py", {**BAGEL_OMNI, "rollout.bagel_deploy": "two_stage", "sample.think": True},
     "config.rollout.bagel_deploy: 'two_stage' has no think mode yet (the thinker only prefills): BAGEL's think mode "
     "runs in the single-stage deployment only: pass --config.rollout.bagel_deploy=single_stage or "
     "--config.sample.think=False"),
])
def test_each_engine_rule_fails_at_validation_in_one_line(recipe, changes, message):
    with pytest.raises(UserError) as err:
        validation.validate(config(recipe, changes))
    assert str(err.value) == message and "\n" not in message


def test_what_the_engine_runs_passes(tmp_path):
    validation.validate(config("tiny_bagel_ocr.py", {**BAGEL_OMNI, "rollout.bagel_deploy": "two_stage"}))
    cfg = tiny_config(tmp_path)
    cfg.rollout.update(engine="vllm_omni", dtype="bfloat16", device="cuda:0")
    with pytest.raises(UserError, match="rollout.device: 'cuda:0'"):
        validation.validate(cfg)
    cfg.rollout.device = "cuda"
    validation.validate(cfg)


def test_the_engine_and_the_validation_stage_call_the_same_rules(tmp_path, monkeypatch):
    """A rule changed in the family's spec changes both sides: the config's validation and the engine's start (before
    vLLM-Omni starts anything); the engine's module holds no copy of the dtype and device checks."""
    def refuse_all(**settings):
        yield "sample.think", f"{settings['init']!r}: refused by the one copy"

    monkeypatch.setattr(bagel_spec, "vllm_omni_problems", refuse_all)
    with pytest.raises(UserError, match=r"^config\.sample\.think: 'checkpoint': refused by the one copy$"):
        validation.validate(config("tiny_bagel_ocr.py", BAGEL_OMNI))
    omni = install_fake_vllm_omni(monkeypatch, tmp_path, {})
    with pytest.raises(ValueError, match=r"^vllm_omni engine: sample\.think='random': refused by the one copy$"):
        vllm_omni_engine.VllmOmniEngine({"engine": "vllm_omni", "model": "tiny_bagel", "random_seed": 3})
    assert omni.started == []
    assert vllm_omni_engine.engine_problems is rules.engine_problems
    assert vllm_omni_engine.family_problems is rules.family_problems and validation.vllm_omni_rules is rules


def test_cfg_forward_is_checked_by_one_function(tmp_path, monkeypatch):
    """rollout.cfg_forward's check is the contract's `cfg_forward_choice`, which the diffusers engine calls too."""
    from jaxflow_bridge.contract import schedule
    from jaxflow_bridge.engines import diffusers

    cfg = tiny_config(tmp_path)
    cfg.rollout.cfg_forward = "both"
    with pytest.raises(UserError, match=r"^config\.rollout\.cfg_forward: 'both'; choose one of \('split', 'batched'\)$"):
        validation.validate(cfg)
    assert diffusers.cfg_forward_choice is schedule.cfg_forward_choice
    monkeypatch.setattr(validation, "cfg_forward_choice", lambda value: value)
    validation.validate(cfg)  # the stage holds no second copy


@pytest.mark.parametrize("changes, message", [
    ({"rollout.quantization": "fp8"},
     "config.rollout.quantization: 'fp8' is vLLM-Omni's quantized DiT: it needs rollout.engine='vllm_omni' (a "
     "bfloat16 rollout), not 'diffusers'; leave it 'none'"),
    ({"rollout.quantization": "fp8", "rollout.engine": "vllm_omni", "rollout.device": "cuda"},
     "config.rollout.dtype: 'float32': Qwen-Image runs with 'bfloat16' on the vllm_omni engine (vLLM-Omni 0.20 runs "
     "bfloat16 only: its warm-up fails on float32 folders); use rollout.engine='diffusers' for float32"),
    ({"rollout.quantization": "int8", **BAGEL_OMNI},
     "config.rollout.quantization: 'int8'; choose one of ('none', 'fp8')"),
    ({"rollout.quantization": "fp8", "rollout.lora_apply": "merged", **BAGEL_OMNI},
     "config.rollout.lora_apply: 'merged' with rollout.quantization='fp8': the merge adds the adapter to bf16 base "
     "weights, and vLLM-Omni 0.20's FP8 linears hold float8 weights quantized once at load (one scale per tensor), "
     "which take no merge; use rollout.lora_apply='layers' (or 'auto')"),
])
def test_fp8_rollout_refusals_at_validation(changes, message):
    """rollout.quantization='fp8': vLLM-Omni's engine only, a bf16 rollout, never with the LoRA merged."""
    with pytest.raises(UserError) as err:
        validation.validate(config("tiny_ocr.py", changes))
    assert str(err.value) == message


def test_fp8_rollout_passes_with_the_lora_as_layers():
    for lora_apply in ("auto", "layers", "folder"):
        validation.validate(config("tiny_ocr.py", {**BAGEL_OMNI, "rollout.quantization": "fp8",
                                                   "rollout.lora_apply": lora_apply}))


def test_the_engine_starts_vllm_omni_quantized_and_refuses_fp8_merged(tiny_path, tmp_path, monkeypatch):
    """quantization='fp8' reaches AsyncOmni's start keywords (vLLM-Omni 0.20 maps `quantization` to its diffusion
    stages' quantization_config); 'none' sends none; merged with FP8 and an unknown method are refused before
    vLLM-Omni starts."""
    from types import SimpleNamespace

    from jaxflow_bridge.families.qwen_image import vllm_omni_pipeline as vop
    from tests.helpers_vllm_omni import FakeOmniQwenImagePipeline

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pipeline = vop.build_pipeline_class(FakeOmniQwenImagePipeline, SimpleNamespace)
    omni = install_fake_vllm_omni(monkeypatch, tmp_path, {vop.PIPELINE_CLASS: pipeline})
    base = {"engine": "vllm_omni", "model": str(tiny_path)}
    engine = vllm_omni_engine.VllmOmniEngine({**base, "quantization": "fp8"})
    assert omni.started[-1].kwargs["quantization"] == "fp8" and engine.info()["quantization"] == "fp8"
    vllm_omni_engine.VllmOmniEngine({**base, "quantization": "none"})
    assert "quantization" not in omni.started[-1].kwargs
    for config_, match in (({"quantization": "fp8", "lora_apply": "merged"}, r"rollout\.lora_apply='merged' with "),
                           ({"quantization": "fp4"}, r"rollout\.quantization='fp4'; choose one of")):
        with pytest.raises(ValueError, match=rf"^vllm_omni engine: {match}"):
            vllm_omni_engine.VllmOmniEngine({**base, **config_})
    assert len(omni.started) == 2
