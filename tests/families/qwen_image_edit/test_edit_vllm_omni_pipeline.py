"""The edit family on the vllm_omni engine, CPU-testable parts (no vLLM-Omni here): our pipeline class over a
stand-in of vLLM-Omni's QwenImageEdit(Plus)Pipeline on the tiny edit model's diffusers components gives the diffusers
edit pipeline's trajectory (reference latents included) for the same seeds; the request carries the prompt's images
once; the kind picks the class by the folder; the vllm_omni engine sends each prompt's images in its request."""
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from jaxflow_bridge.contract.trajectory import TrajectoryBatch
from jaxflow_bridge.engines.vllm_omni import codec
from jaxflow_bridge.engines.vllm_omni.engine import VllmOmniEngine
from jaxflow_bridge.engines.vllm_omni.kinds import family_of, model_kind
from jaxflow_bridge.engines.vllm_omni.rules import problems
from jaxflow_bridge.families.qwen_image_edit import vllm_omni_pipeline as vop
from jaxflow_bridge.families.qwen_image_edit.diffusers_pipeline import RolloutPipeline
from jaxflow_bridge.families.qwen_image_edit.tiny import tiny_pipeline_path
from jaxflow_bridge.rollout.sampling import SamplingParams
from tests.helpers import ROOT
from tests.helpers_vllm_omni import FakeDiffusionOutput, assert_batches_equal, install_fake_vllm_omni, warmup_request

SIZE = 32  # the tiny VAE: 8 pixels a packed token
SAMPLING = SamplingParams(height=SIZE, width=SIZE, num_inference_steps=4, true_cfg_scale=4.0, noise_level=1.2,
                          sde_window_size=2, sde_window_range=(0, 3), max_sequence_length=64, seed=5)
SEEDS = [10, 11, 12]
PROMPT = 'make the sign read "OPEN"'


class FakeOmniQwenImageEditPipeline(torch.nn.Module):
    """What our class uses of vLLM-Omni 0.20's QwenImageEdit(Plus)Pipeline, on the tiny diffusers components: the
    whole VL text encoder, its attribute names, and its own `image_processor` (a VaeImageProcessor, unused by ours)."""

    def __init__(self, *, od_config, prefix=""):
        import diffusers
        from diffusers.image_processor import VaeImageProcessor

        super().__init__()
        name = "QwenImageEditPlusPipeline" if "plus" in od_config.model else "QwenImageEditPipeline"
        pipe = getattr(diffusers, name).from_pretrained(od_config.model, processor=None, local_files_only=True)
        self.od_config, self.scheduler, self.tokenizer = od_config, pipe.scheduler, pipe.tokenizer
        self.text_encoder, self.vae, self.transformer = pipe.text_encoder, pipe.vae, pipe.transformer
        self.prompt_template_encode = pipe.prompt_template_encode
        self.prompt_template_encode_start_idx = pipe.prompt_template_encode_start_idx
        self.vae_scale_factor, self.device = pipe.vae_scale_factor, torch.device("cpu")
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * 2)

    def forward(self, req):
        return "stock pipeline"


def references(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, SIZE, SIZE, 3), dtype=np.uint8)


@pytest.mark.parametrize("plus, count", [(False, 1), pytest.param(True, 2, marks=pytest.mark.slow)],
                         ids=["edit", "plus"])
def test_the_vllm_omni_class_gives_the_diffusers_edit_trajectory(plus, count):
    """One request (the prompt, its images once, n = 3 outputs) through our class on vLLM-Omni's stand-in: the
    diffusers edit pipeline's trajectory for the same seeds, bit for bit (float32 CPU), reference latents included."""
    folder = tiny_pipeline_path(plus=plus)
    cls = vop.build_pipeline_class(FakeOmniQwenImageEditPipeline, FakeDiffusionOutput, plus=plus)
    assert cls.__module__ == vop.__name__ and f"{vop.__name__}.{cls.__qualname__}" == vop.PIPELINE_CLASSES[
        "QwenImageEditPlusPipeline" if plus else "QwenImageEditPipeline"]
    ours = cls(od_config=SimpleNamespace(model=str(folder), custom_pipeline_args={"pipeline_class": "x"}))
    images = references(count)
    prompt, kwargs = vop.encode_request(PROMPT, SAMPLING, SEEDS, policy_version=3, references=images)
    assert kwargs["num_outputs_per_prompt"] == 3 and len(prompt["multi_modal_data"]["image"]) == count
    prompt["additional_information"] = {"prompt_image": "vLLM-Omni's resized copy, unused"}  # its pre-processing
    with torch.inference_mode():
        result = ours.forward(SimpleNamespace(prompts=[prompt], sampling_params=SimpleNamespace(**kwargs)))
        stock = ours.forward(SimpleNamespace(prompts=[{"prompt": "dummy run"}],
                                             sampling_params=SimpleNamespace(extra_args={})))
        blank = Image.new("RGB", (512, 512))  # vLLM-Omni's start-up warm-up (`_dummy_run`) for a model taking images
        warmup = ours.forward(warmup_request({"prompt": "dummy run", "multi_modal_data": {vop.IMAGES: blank}}))
    assert stock == "stock pipeline" and warmup == FakeDiffusionOutput()
    got = codec.unpack_trajectories(result, PROMPT, group_id=0)
    ref = RolloutPipeline.from_pretrained(folder, dtype="float32", device="cpu")
    ref.policy_version = 3
    want = ref.generate([PROMPT], 3, SAMPLING, SEEDS, references=[images])
    assert got.reference_latents.shape == (3, count, (SIZE // 8) ** 2, 64)
    assert_batches_equal(got, want)


def test_the_request_carries_the_images_and_refuses_none():
    images = references(1, seed=4)
    prompt, _ = vop.encode_request(PROMPT, SAMPLING, SEEDS, 0, references=images)
    params = SimpleNamespace(**vop.encode_request(PROMPT, SAMPLING, SEEDS, 0, references=images)[1])
    *_, (back,) = vop.decode_request([prompt], params)
    assert back.dtype == np.uint8 and np.array_equal(back, images)  # the exact pixels, through PIL
    with pytest.raises(ValueError, match="reference images"):
        vop.encode_request(PROMPT, SAMPLING, SEEDS, 0)
    with pytest.raises(ValueError, match=r"uint8 \(R, height, width, 3\)"):
        vop.encode_request(PROMPT, SAMPLING, SEEDS, 0, references=images.astype(np.float32))
    with pytest.raises(ValueError, match=r"multi_modal_data\['image'\]"):
        vop.decode_request([{"prompt": PROMPT, "negative_prompt": " "}], params)


def test_a_size_vllm_omnis_edit_pre_processing_would_change_is_refused():
    """vLLM-Omni 0.20 rounds an edit request's size down to multiples of 16 whatever the VAE (the tiny's is 8): the
    request is refused with the nearest sizes that work, never sampled at another size."""
    at = dataclasses.replace(SAMPLING, height=40, width=72)
    with pytest.raises(ValueError, match=r"^vllm_omni engine: 40x72 \(sample.height x sample.width\).* multiples of "
                                         r"16 .*use one of 32x64, 32x80, 48x64, 48x80$"):
        vop.encode_request(PROMPT, at, SEEDS, 0, references=references(1))
    prompt, _ = vop.encode_request(PROMPT, dataclasses.replace(SAMPLING, height=48, width=80), SEEDS, 0,
                                   references=references(1))
    assert prompt["prompt"] == PROMPT


def test_the_engine_serves_an_edit_folder_with_the_edit_class():
    folder = tiny_pipeline_path()
    assert family_of(str(folder)) == family_of("tiny_edit") == "qwen_image_edit"
    kind = model_kind("tiny_edit", "float32")
    args = kind.pipeline_args({"cfg_forward": "split"})
    assert args["pipeline_class"] == vop.PIPELINE_CLASS and args["cfg_forward"] == "split"
    assert kind.encode_request is vop.encode_request and kind.size_multiple == 8
    plus = model_kind(str(tiny_pipeline_path(plus=True)), "float32")
    assert plus.pipeline_args({})["pipeline_class"] == vop.PLUS_PIPELINE_CLASS
    assert vop.PIPELINE_CLASS in codec.our_pipelines()
    assert list(problems("qwen_image_edit", dtype="bfloat16", device=None, init="checkpoint", deploy=None)) == []
    assert [k for k, _ in problems("qwen_image_edit", dtype="bfloat16", device=None, init="checkpoint",
                                   deploy="two_stage")] == ["rollout.bagel_deploy"]


def test_the_engine_sends_each_prompts_images_once(tmp_path, monkeypatch):
    """VllmOmniEngine.generate with `references` (one array per prompt, as the rollout server passes them): one
    request per prompt, carrying that prompt's images once for its n samples; each group's trajectory conditioned on
    its own images (reference latents shared within a group, not across); a count that is not one per prompt
    refused."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    cls = vop.build_pipeline_class(FakeOmniQwenImageEditPipeline, SimpleNamespace)
    omni = install_fake_vllm_omni(monkeypatch, tmp_path, {vop.PIPELINE_CLASS: cls})
    engine = VllmOmniEngine({"engine": "vllm_omni", "model": str(tiny_pipeline_path())})
    images = [references(1, seed=1), references(1, seed=2)]
    sampling = dataclasses.asdict(dataclasses.replace(SAMPLING, num_inference_steps=2, sde_window_size=1, sde_window_range=(0, 1)))
    out = TrajectoryBatch.from_dict(engine.generate([PROMPT, "paint it blue"], 2, sampling, seeds=[1, 2, 3, 4],
                                                    references=images))
    (started,) = omni.started
    assert [p["prompt"] for p, _ in started.requests] == [PROMPT, "paint it blue"]
    for (prompt, params), sent in zip(started.requests, images):
        assert params.num_outputs_per_prompt == 2
        (image,) = prompt["multi_modal_data"]["image"]
        assert np.array_equal(np.asarray(image), sent[0])
    assert out.reference_latents.shape[:2] == (4, 1) and list(out.seeds) == [1, 2, 3, 4]
    lat = out.reference_latents
    assert np.array_equal(lat[0], lat[1]) and np.array_equal(lat[2], lat[3]) and not np.array_equal(lat[0], lat[2])
    with pytest.raises(ValueError, match="one array of images per prompt"):
        engine.generate([PROMPT, "paint it blue"], 2, sampling, references=images[:1])


def test_an_eval_call_keeps_one_request_per_prompt(tmp_path, monkeypatch):
    """n = 1 (the eval): an edit call is not packed (its other prompts' images would ride in extra_args): one request
    per prompt, each with its own images; a packed request reaching the pipeline is refused in one line."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    omni = install_fake_vllm_omni(monkeypatch, tmp_path, {
        vop.PIPELINE_CLASS: vop.build_pipeline_class(FakeOmniQwenImageEditPipeline, SimpleNamespace)})
    images = [references(1, seed=1), references(1, seed=2)]
    sp = dataclasses.replace(SAMPLING, num_inference_steps=2, sde_type="ode", noise_level=0.0, sde_window_size=None)
    out = TrajectoryBatch.from_dict(VllmOmniEngine({"engine": "vllm_omni", "model": str(tiny_pipeline_path())}).generate(
        [PROMPT, "paint it blue"], 1, dataclasses.asdict(sp), seeds=[7, 8], references=images))
    (started,) = omni.started
    assert [p["prompt"] for p, _ in started.requests] == [PROMPT, "paint it blue"]
    assert list(out.seeds) == [7, 8] and not np.array_equal(out.reference_latents[0], out.reference_latents[1])
    prompt, params = started.requests[0]
    packed = SimpleNamespace(**{**vars(params), "num_outputs_per_prompt": 2, "seeds": None,
                                "extra_args": {**params.extra_args, "seeds": [7, 8],
                                               "prompts": [PROMPT, "paint it blue"]}})
    with pytest.raises(ValueError, match="^an edit rollout request carries one prompt, got a packed one of 2$"):
        vop.decode_request([prompt], packed)
