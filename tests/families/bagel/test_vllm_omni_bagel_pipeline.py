"""jaxflow_bridge/families/bagel/vllm_omni_pipeline.py on the CPU: the request codec, and FlowGRPOBagelPipeline built
on a stand-in for vLLM-Omni's BagelPipeline and Bagel (tests/helpers_vllm_omni_bagel.py: their prefill, think decode,
packing, merged CFG caches, `_combine_cfg` and `generate_image` loop, each packed sequence evaluated by the
bagel_torch engine's model). A request's n samples run in lockstep, one LLM forward a step for all of them and both
CFG branches, and each sample must be the `bagel_torch` engine's sample of its seed run alone, byte for byte: the
stand-in computes every sequence as that engine does a batch of one, on the same draws, so any difference is ours
(packing, per-sample renorm, scheduler split). The stand-in's steps run at our sigmas (the engine's own shifted
timesteps differ by float32 rounding: a GPU question, docs/bagel.md §7 (f)). vLLM-Omni itself is not imported
here."""
import dataclasses
import functools
import types

import numpy as np
import pytest
import torch
from PIL import Image

from jaxflow_bridge.contract.trajectory import TrajectoryBatch
from jaxflow_bridge.families.bagel import vllm_omni_pipeline as vob
from jaxflow_bridge.families.bagel.sampling import BagelSamplingParams
from jaxflow_bridge.families.bagel.engine import BagelTorchEngine, context_ids
from jaxflow_bridge.families.bagel.vllm_omni_pipeline import (build_pipeline_class, decode_request, encode_request,
                                                             is_rollout_request)
from jaxflow_bridge.engines.vllm_omni.codec import unpack_trajectories
from tests.helpers_vllm_omni import FakeDiffusionOutput, warmup_request
from tests.helpers_vllm_omni_bagel import NaiveCache, stock_bagel_pipeline

SP = BagelSamplingParams(height=64, width=96, num_inference_steps=4, sde_window_range=(0, 3), cfg_interval=(0.8, 1.0),
                         cfg_text_scale=4.0)
CFG = dataclasses.replace(SP, keep_final=True)
THINK = dataclasses.replace(SP, think=True, max_think_tokens=40)  # the tiny model ends this prompt's think early
PROMPT, SEEDS = "a red sign", [21, 22, 23]


@pytest.fixture(scope="module")
def engine():
    return BagelTorchEngine({"engine": "bagel_torch", "model": "tiny_bagel", "decode": "preview"})


def request(sp=SP, seeds=SEEDS):
    prompt, kwargs = encode_request(PROMPT, sp, seeds, 5)
    params = types.SimpleNamespace(**{k: v for k, v in kwargs.items() if k != "extra_args"},
                                   extra_args=kwargs["extra_args"])
    return types.SimpleNamespace(prompts=[prompt], sampling_params=params)


def pipeline_on(engine, output_cls=lambda **kw: types.SimpleNamespace(**kw)):
    return build_pipeline_class(stock_bagel_pipeline(engine), output_cls, NaiveCache)(od_config=None)


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
    """Our pipeline's request of SEEDS on the stand-in: (trajectories, the pipeline)."""
    pipeline = pipeline_on(engine)
    result = pipeline.forward(request(sp))
    out = unpack_trajectories(result, PROMPT, 0)
    np.testing.assert_array_equal(result.output.numpy(), out.images)  # what the engine's images show
    assert "_combine_cfg" not in vars(pipeline.bagel) and pipeline.scheduler is None  # the stock pieces restored
    assert list(out.policy_versions) == [5] * len(SEEDS)
    return out, pipeline


@functools.cache
def alone(engine, sp, seed):
    """The engine's sample of `seed` in a batch of its own (a batch's matmuls round per shape); kept across tests."""
    return TrajectoryBatch.from_dict(engine.generate([PROMPT], 1, dataclasses.asdict(sp), seeds=[seed]))


def assert_sample(got, j, want, fields=FIELDS):
    """Fields of `got`'s samples `j` (a slice) byte-equal to `want`'s."""
    for field in fields:
        a, b = getattr(got, field), getattr(want, field)
        assert (a is None) == (b is None), field
        if a is not None:
            np.testing.assert_array_equal(a if field == "sigmas" else a[j], b, err_msg=field)


@pytest.mark.parametrize("sp", [CFG, dataclasses.replace(SP, cfg_text_scale=1.0), THINK],
                         ids=["cfg", "no_cfg", "think"])
def test_a_requests_samples_are_the_bagel_torch_engines(engine, sp):
    """Each of n = 3 samples packed in one `generate_image` is the engine's sample alone; in think mode the tokens of
    the request's one decode follow each sample's context in `prompt_ids`."""
    got, _ = rollout(engine, sp)
    for j, seed in enumerate(SEEDS):
        assert_sample(got, slice(j, j + 1), alone(engine, sp, seed))
    context = len(context_ids(engine.tokenizer, PROMPT))
    assert (got.prompt_ids.shape[1] > context + 1) is sp.think


def test_one_llm_forward_a_step_for_every_sample_and_branch(engine):
    """One prefill and one think decode a request (one sequence each), then one gen-mode forward a step over the
    n samples packed: 2n sequences at the guided steps (sigma in (0.8, 1]: 1 and 0.9 here), n at the others."""
    got, pipeline = rollout(engine, THINK)
    thought = got.prompt_ids.shape[1] - len(context_ids(engine.tokenizer, PROMPT))
    n = len(SEEDS)
    assert pipeline.bagel.llm_forwards == [("und", 1)] * (1 + thought) + [("gen", 2 * n)] * 2 + [("gen", n)] * 2


def test_same_latent_gives_the_group_the_first_samples_initial_latents(engine):
    """Sample 0 is the engine's alone; every sample is the engine's batch of the same request (the group starting
    from sample 0's initial latents, each keeping its own window and step noise) within 1e-5: that batch runs its
    matmuls on 3 rows, which round otherwise than 1 (1.7e-6 seen); sample 1 alone (its own initial latents) is off."""
    sp = dataclasses.replace(CFG, same_latent=True)
    got, _ = rollout(engine, sp)
    assert_sample(got, slice(0, 1), alone(engine, CFG, SEEDS[0]))  # alone, same_latent changes nothing
    group = TrajectoryBatch.from_dict(engine.generate([PROMPT], len(SEEDS), dataclasses.asdict(sp), seeds=SEEDS))
    assert_sample(got, slice(None), group, ("images", "step_index", "prompt_ids"))
    for field in ("latents", "log_probs", "final_latents"):
        np.testing.assert_allclose(getattr(got, field), getattr(group, field), rtol=0, atol=1e-5, err_msg=field)
    own = alone(engine, CFG, SEEDS[1])
    np.testing.assert_array_equal(got.step_index[1:2], own.step_index)
    assert np.abs(got.final_latents[1:2] - own.final_latents).max() > 1e-2


def test_the_renorm_is_per_sample_not_over_the_packed_batch(engine, monkeypatch):
    """vLLM-Omni's "global" renorm over packed (n S, C) velocities scales every sample by one batch-wide factor;
    `per_sample_cfg` gives each sample its own (the combine of its rows alone). Without it in the pipeline (the stock
    combine on the packed tensor) the samples leave the engine's; with it they are the engine's (tests above)."""
    stock = stock_bagel_pipeline(engine)(od_config=None).bagel._combine_cfg
    v, v_text = torch.randn(3, 24, 64) * torch.tensor([0.5, 1.0, 2.0])[:, None, None], torch.randn(3, 24, 64)
    args = (None, 4.0, 1.0, "global", 0.0)
    ours = vob.per_sample_cfg(stock, [24] * 3)(v.flatten(0, 1), v_text.flatten(0, 1), *args)
    torch.testing.assert_close(ours, torch.cat([stock(a, b, *args) for a, b in zip(v, v_text)]), rtol=0, atol=0)
    assert (ours - stock(v.flatten(0, 1), v_text.flatten(0, 1), *args)).abs().max() > 1e-2
    calls = []
    monkeypatch.setattr(vob, "per_sample_cfg", lambda combine, rows: calls.append(rows) or combine)
    got, pipeline = rollout(engine, CFG)
    assert calls == [[24] * len(SEEDS)] and "_combine_cfg" not in vars(pipeline.bagel)
    for j, seed in enumerate(SEEDS):
        want = alone(engine, CFG, seed)
        np.testing.assert_array_equal(got.step_index[j:j + 1], want.step_index)
        assert np.abs(got.final_latents[j:j + 1] - want.final_latents).max() > 1e-3, j


def test_other_requests_run_the_stock_bagel_pipeline(engine):
    pipeline = pipeline_on(engine, lambda **kw: kw)
    params = types.SimpleNamespace(height=64, width=96, num_inference_steps=5, seed=0,
                                   extra_args={"cfg_text_scale": 4.0, "cfg_interval": [0, 1], "cfg_renorm_min": 0.0,
                                               "cfg_img_scale": 1.0, "negative_prompt": ""})
    out = pipeline.forward(types.SimpleNamespace(prompts=[PROMPT], sampling_params=params))
    assert isinstance(out.output, Image.Image) and out.output.size == (96, 64)
    assert pipeline.bagel.llm_forwards == [("und", 1)] + [("gen", 2)] * 4  # the stock forward: one image, 2 branches


def test_the_start_up_warm_up_is_answered_empty(engine):
    """vLLM-Omni's engine start sends one warm-up request (`DiffusionEngine._dummy_run`, which reads only the result's
    `error`): an empty DiffusionOutput, no LLM forward (the stock forward would run one image's prefill and steps)."""
    pipeline = pipeline_on(engine, FakeDiffusionOutput)
    answer = pipeline.forward(warmup_request())
    assert answer == FakeDiffusionOutput() and answer.error is None and pipeline.bagel.llm_forwards == []


def test_every_bias_is_loaded_again_in_a_call_of_its_own():
    """vLLM 0.20's online FP8 loses a quantized linear's bias within a load call (engines/vllm_omni/bias_reload.py):
    the pipeline hands the stock loader the whole stream, then its biases again."""
    calls = []

    class Base:
        def __init__(self, *, od_config, **kwargs):
            pass

        def load_weights(self, weights):
            calls.append(list(weights))
            return {name for name, _ in calls[-1]}

    pipe = build_pipeline_class(Base, FakeDiffusionOutput, NaiveCache)(od_config=None)
    stream = [("bagel.language_model.model.layers.0.self_attn.q_proj.bias", 0),
              ("bagel.language_model.model.layers.0.self_attn.q_proj.weight", 1), ("vae.decoder.conv_in.weight", 2)]
    assert pipe.load_weights(iter(stream)) == {name for name, _ in stream}
    assert calls == [stream, stream[:1]]
