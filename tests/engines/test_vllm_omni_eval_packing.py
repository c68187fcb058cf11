"""The vllm_omni engine packs a call of one sample per prompt (the eval's) into few requests (vLLM-Omni 0.20 runs one
request at a time): the packed request's codec, and on the stand-in vLLM-Omni the same samples, order and seeds as one
request per prompt, up to the batch's own float32 numerics."""
import dataclasses
from types import SimpleNamespace

import pytest

from jaxflow_bridge.contract.trajectory import TrajectoryBatch
from jaxflow_bridge.engines.vllm_omni.codec import request_groups
from jaxflow_bridge.engines.vllm_omni.engine import VllmOmniEngine
from jaxflow_bridge.families.qwen_image import vllm_omni_pipeline as vop
from jaxflow_bridge.families.qwen_image.diffusers_pipeline import RolloutPipeline
from tests.batch_numerics import assert_same_samples
from tests.helpers import ROOT
from tests.helpers_vllm_omni import SAMPLING, FakeOmniQwenImagePipeline, assert_batches_equal, install_fake_vllm_omni

# the eval's sampling (the family's eval_mode): ODE, one image per prompt, true CFG
EVAL = dataclasses.replace(SAMPLING, sde_type="ode", noise_level=0.0, sde_window_size=None)
PROMPTS = ["a red fox", "a cat reading a long newspaper in the rain", "ok"]  # text of three lengths: padded apart
SEEDS = [4, 5, 6]


def test_request_groups():
    assert request_groups(5, 1, True, None) == [range(0, 5)]
    assert request_groups(5, 1, True, 2) == [range(0, 2), range(2, 4), range(4, 5)]
    assert request_groups(3, 2, True, 16) == [range(0, 1), range(1, 2), range(2, 3)]  # training: one prompt each
    assert request_groups(3, 1, False, None) == [range(0, 1), range(1, 2), range(2, 3)]  # a kind that never packs


def test_the_packed_request_round_trips_and_refuses_a_malformed_one():
    prompt, kwargs = vop.encode_packed(PROMPTS, EVAL, SEEDS, policy_version=2)
    assert prompt == {"prompt": PROMPTS[0], "negative_prompt": " "} and kwargs["num_outputs_per_prompt"] == 3
    params = SimpleNamespace(**kwargs)
    assert vop.is_rollout_request(params)
    assert vop.decode_request([prompt], params) == (PROMPTS, EVAL, 1, SEEDS, 2)
    with pytest.raises(ValueError, match="one sample per prompt: 2 seeds for 3 prompts"):
        vop.encode_packed(PROMPTS, EVAL, SEEDS[:2], policy_version=2)
    for change in ({"num_outputs_per_prompt": 2}, {"extra_args": {**kwargs["extra_args"], "seeds": SEEDS[:2]}},
                   {"extra_args": {**kwargs["extra_args"], vop.PACKED: PROMPTS[::-1]}},
                   {"extra_args": {**kwargs["extra_args"], vop.PACKED: "a red fox"}}):
        with pytest.raises(ValueError, match=r"^a packed rollout request carries its prompts in extra_args\['prompts'"):
            vop.decode_request([prompt], SimpleNamespace(**{**kwargs, **change}))


def test_an_eval_call_goes_in_one_request_with_the_samples_of_one_request_per_prompt(tiny_path, tmp_path,
                                                                                     monkeypatch):
    """n = 1: the call's prompts in one request (3 before), its samples the diffusers engine's batch of the same
    prompts bit for bit, and those of one request per prompt (`request_images=1`) within the batch's numerics, in the
    same order with the same seeds."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    omni = install_fake_vllm_omni(monkeypatch, tmp_path, {
        vop.PIPELINE_CLASS: vop.build_pipeline_class(FakeOmniQwenImagePipeline, SimpleNamespace)})
    sampling = dataclasses.asdict(EVAL)
    packed = VllmOmniEngine({"engine": "vllm_omni", "model": str(tiny_path)})
    got = TrajectoryBatch.from_dict(packed.generate(PROMPTS, 1, sampling, seeds=SEEDS))
    single = VllmOmniEngine({"engine": "vllm_omni", "model": str(tiny_path), "request_images": 1})
    want = TrajectoryBatch.from_dict(single.generate(PROMPTS, 1, sampling, seeds=SEEDS))
    assert [len(o.requests) for o in omni.started] == [1, 3]
    (prompt, params), = omni.started[0].requests
    assert prompt["prompt"] == PROMPTS[0] and params.num_outputs_per_prompt == 3
    assert list(got.prompts) == PROMPTS and list(got.group_ids) == [0, 1, 2] and list(got.seeds) == SEEDS
    assert_same_samples(got, want, omni.started[0].worker.model_runner.pipeline, EVAL)
    ref = RolloutPipeline.from_pretrained(tiny_path, dtype="float32", device="cpu")
    assert_batches_equal(got, ref.generate(PROMPTS, 1, EVAL, SEEDS))
    with pytest.raises(ValueError, match=r"request_images=0; pass an int >= 1"):
        VllmOmniEngine({"engine": "vllm_omni", "model": str(tiny_path), "request_images": 0})
