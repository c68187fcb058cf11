"""jaxflow_bridge/rollout/vllm_omni_bagel_pipeline.py on the CPU: the request codec, and FlowGRPOBagelPipeline built
on a stand-in for vLLM-Omni's BagelPipeline (tests/helpers_vllm_omni.py) that uses the two hooks as the stock
`forward` does (its reading, docs/bagel.md §7 (d)): `self.bagel.prepare_vae_latent` draws the initial latents (here
from the global RNG) and `Bagel.generate_image` hands every step, after the CFG combine, to
`self.scheduler.step(v, t, x, dt)`; with extra_args' `think` it decodes through `self.bagel.generate_text`, whose
returned tokens our pipeline records. The stand-in's steps run at our sigmas (the engine's own shifted timesteps
differ by float32 rounding: a GPU question, docs/bagel.md §7 (f)), so a request's samples must be the `bagel_torch`
engine's, byte for byte: the same prefills and velocities on the same draws. vLLM-Omni itself is not imported
here."""
import dataclasses
import types

import numpy as np
import pytest
from PIL import Image

from jaxflow_bridge.contract.trajectory import TrajectoryBatch
from jaxflow_bridge.rollout.bagel_sampling import BagelSamplingParams
from jaxflow_bridge.rollout.engine_bagel import BagelTorchEngine, context_ids
from jaxflow_bridge.rollout.vllm_omni_bagel_pipeline import (build_pipeline_class, decode_request, encode_request,
                                                             is_rollout_request)
from jaxflow_bridge.rollout.vllm_omni_pipeline import unpack_trajectories
from tests.helpers_vllm_omni import stock_bagel_pipeline

SP = BagelSamplingParams(height=64, width=96, num_inference_steps=4, sde_window_range=(0, 3), cfg_interval=(0.8, 1.0))
THINK = dataclasses.replace(SP, think=True, max_think_tokens=40)  # the tiny model ends this prompt's think early
PROMPT, SEEDS = "a red sign", [21, 22]


@pytest.fixture(scope="module")
def engine():
    return BagelTorchEngine({"engine": "bagel_torch", "model": "tiny_bagel", "decode": "preview"})


def request(sp=SP, seeds=SEEDS):
    prompt, kwargs = encode_request(PROMPT, sp, seeds, 5)
    params = types.SimpleNamespace(**{k: v for k, v in kwargs.items() if k != "extra_args"},
                                   extra_args=kwargs["extra_args"])
    return types.SimpleNamespace(prompts=[prompt], sampling_params=params)


def test_the_codec_round_trips_and_asks_the_engine_for_n_plus_one_points():
    req = request()
    assert is_rollout_request(req.sampling_params) and req.sampling_params.num_inference_steps == SP.num_inference_steps + 1
    prompt, sp, seeds, version = decode_request(req.prompts, req.sampling_params)
    assert (prompt, sp, seeds, version) == (PROMPT, SP, SEEDS, 5)
    extra = request(THINK).sampling_params.extra_args  # the stock forward's own think keys, greedy
    assert (extra["think"], extra["max_think_tokens"], extra["do_sample"]) == (True, 40, False)
    assert decode_request([{"prompt": PROMPT}], request(THINK).sampling_params)[1] == THINK
    assert not is_rollout_request(types.SimpleNamespace(extra_args={"cfg_text_scale": 4.0}))


FIELDS = ("images", "latents", "log_probs", "sigmas", "step_index", "prompt_ids", "prompt_mask", "negative_prompt_ids",
          "seeds", "final_latents")


def rollout(engine, sp):
    pipeline = build_pipeline_class(stock_bagel_pipeline(engine), lambda **kw: types.SimpleNamespace(**kw))(od_config=None)
    result = pipeline.forward(request(sp))
    out = unpack_trajectories(result, PROMPT, 0)
    np.testing.assert_array_equal(result.output.numpy(), out.images)  # what the engine's images show
    assert pipeline.scheduler is None and not {"prepare_vae_latent", "generate_text"} & set(vars(pipeline.bagel))
    assert list(out.policy_versions) == [5, 5]
    return out


def alone(engine, sp, seed):
    """The engine's sample of `seed` in a batch of its own (a batch's matmuls round per shape)."""
    return TrajectoryBatch.from_dict(engine.generate([PROMPT], 1, dataclasses.asdict(sp), seeds=[seed]))


def assert_sample(got, j, want, fields=FIELDS):
    for field in fields:
        a, b = getattr(got, field), getattr(want, field)
        assert (a is None) == (b is None), field
        if a is not None:
            np.testing.assert_array_equal(a if field == "sigmas" else a[j:j + 1], b, err_msg=field)


@pytest.mark.parametrize("sp", [dataclasses.replace(SP, keep_final=True), dataclasses.replace(SP, cfg_text_scale=1.0),
                                dataclasses.replace(THINK, keep_final=True)], ids=["cfg", "no_cfg", "think"])
def test_a_requests_samples_are_the_bagel_torch_engines(engine, sp):
    """Think mode too: the tokens the stock forward's decode fed follow each sample's context in `prompt_ids`."""
    got = rollout(engine, sp)
    for j, seed in enumerate(SEEDS):
        assert_sample(got, j, alone(engine, sp, seed))
    context = len(context_ids(engine.tokenizer, PROMPT))
    assert (got.prompt_ids.shape[1] > context + 1) is sp.think


def test_a_think_request_whose_stock_forward_did_not_decode_is_refused(engine):
    class Deaf(stock_bagel_pipeline(engine)):  # a stock forward that ignores extra_args' think
        def forward(self, req):
            req.sampling_params.extra_args = {**req.sampling_params.extra_args, "think": False}
            return super().forward(req)

    pipeline = build_pipeline_class(Deaf, lambda **kw: types.SimpleNamespace(**kw))(od_config=None)
    with pytest.raises(RuntimeError, match="ran 0 think decodes for think=True"):
        pipeline.forward(request(THINK))
    assert "generate_text" not in vars(pipeline.bagel)  # hooks released


def test_same_latent_gives_the_group_the_first_samples_initial_latents(engine):
    """Sample 0 is the engine's; sample 1 keeps its own window (from its seed) but not its own trajectory."""
    sp = dataclasses.replace(SP, same_latent=True)
    got = rollout(engine, sp)
    assert_sample(got, 0, alone(engine, sp, SEEDS[0]))
    own = alone(engine, sp, SEEDS[1])
    np.testing.assert_array_equal(got.step_index[1:], own.step_index)
    assert not np.array_equal(got.latents[1:], own.latents)


def test_other_requests_run_the_stock_bagel_pipeline(engine):
    pipeline = build_pipeline_class(stock_bagel_pipeline(engine), lambda **kw: kw)(od_config=None)
    params = types.SimpleNamespace(height=64, width=96, num_inference_steps=5, seed=0,
                                   extra_args={"cfg_text_scale": 4.0, "cfg_interval": [0, 1], "cfg_renorm_min": 0.0,
                                               "cfg_img_scale": 1.0, "negative_prompt": ""})
    out = pipeline.forward(types.SimpleNamespace(prompts=[PROMPT], sampling_params=params))
    assert isinstance(out.output, Image.Image) and out.output.size == (96, 64)
