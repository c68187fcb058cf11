"""BAGEL's think mode on the CPU (docs/bagel.md §2, item 3), on the tiny BAGEL folder in float32: the cached greedy
decode (jaxflow_bridge/families/bagel/think.py) against a direct transcription that reruns the whole sequence every
step, its stop rule (after predicting the end token, which is never fed) and its cut at max_think_tokens; the
bagel_torch engine's trajectories with think on (each prompt decoded once, the fed tokens after its context in
`prompt_ids`) and off (the bytes of the plain loop, the decode never run); the config's refusals and the train batch's
text padding. The trainer's recompute of a think rollout: tests/trainer/test_logprob_parity.py; vLLM-Omni's side:
tests/families/bagel/test_vllm_omni_bagel_pipeline.py and test_vllm_omni_bagel_engine.py."""
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from jaxflow.config import derived
from jaxflow.config import validation as config_lib
from jaxflow import families
from jaxflow.config import recipes
from jaxflow.config.errors import UserError
from jaxflow.config.validation import config_module
from jaxflow.run.driver import text_length_error
from jaxflow.families.bagel.loading import folder_config
from jaxflow_bridge.contract.trajectory import TextLengthError, TrajectoryBatch
from jaxflow_bridge.families.bagel.sampling import BagelSamplingLoop
from jaxflow_bridge.families.bagel.think import think_decode
from jaxflow_bridge.families.bagel.engine import BagelTorchEngine, context_ids
from tests import bagel_ref
from tests.bagel_helpers import SP
from tests.helpers import ROOT

PROMPTS = ["a sign", "OCR 42 long prompt here"]  # the tiny model predicts <|im_end|> after 15 tokens of the first
MAX = 40
SAMPLING = dict(height=SP.height, width=SP.width, num_inference_steps=SP.num_inference_steps,
                sde_window_range=SP.sde_window_range, cfg_interval=SP.cfg_interval, keep_final=True,
                cfg_text_scale=SP.cfg_text_scale)
THINK = dict(SAMPLING, think=True, max_think_tokens=MAX)
SEEDS = [1, 2, 3, 4]
LLM = bagel_ref.LLM


@pytest.fixture(scope="module")
def engine():
    return BagelTorchEngine({"engine": "bagel_torch", "model": "tiny_bagel", "decode": "preview"})


@pytest.fixture(scope="module")
def reference(engine):
    """(checkpoint tensors, BagelConfig) of the engine's folder, for the direct transcription."""
    return load_file(f"{engine.model_path}/ema.safetensors"), folder_config(engine.model_path)


def direct_decode(reference, ids, start, end, max_tokens) -> list[int]:
    """Greedy decode without a cache: each step the whole sequence so far through the understanding expert,
    causally (tests/bagel_ref.py), then the argmax of lm_head(norm(h)) of its last token."""
    sd, cfg = reference
    seq, fed, token = list(ids), [], start
    while len(fed) < max_tokens:
        fed.append(token)
        seq.append(token)
        h = sd[LLM + "embed_tokens.weight"][torch.tensor(seq)]
        for i in range(cfg.num_hidden_layers):
            h, _ = bagel_ref._layer(sd, cfg, i, h, [""] * len(seq), torch.arange(len(seq)), None, True)
        logits = F.linear(bagel_ref._rms(h[-1], sd[LLM + "norm.weight"], cfg.rms_norm_eps),
                          sd["language_model.lm_head.weight"])
        token = int(logits.argmax())
        if token == end:
            break
    return fed


def markers(engine) -> tuple[int, int]:
    return tuple(engine.tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]))


def test_the_cached_decode_is_the_direct_one_and_its_context_the_prefill_of_its_tokens(engine, reference):
    """Both prompts decode as the direct transcription does, one stopping at its predicted end token and one cut at
    MAX; the extended context is the prefill of prompt + fed tokens (K/V within 256 float32 ulps of their scale)."""
    start, end = markers(engine)
    lengths = []
    for prompt in PROMPTS:
        ids = context_ids(engine.tokenizer, prompt)
        fed, context = engine.loop.thinker(ids, MAX)
        assert fed == direct_decode(reference, ids, start, end, MAX) and fed[0] == start and end not in fed
        lengths.append(len(fed))
        full = torch.tensor([ids + fed])
        want = engine.model.prefill(full, torch.ones_like(full, dtype=torch.bool))
        assert context.mask.shape == (1, len(ids) + len(fed)) and bool(context.mask.all())
        for got, ref in zip(context.keys + context.values, want.keys + want.values):
            assert float((got - ref).abs().max()) <= 256 * 2.0**-24 * float(ref.abs().max())
    assert lengths[0] < MAX == lengths[1]


def test_the_decode_stops_right_after_predicting_the_end_token_or_at_max_tokens(engine, reference):
    """With the end token set to what the model predicts at step j, j tokens are fed (the prediction never is);
    with max_tokens k, the first k."""
    start, _ = markers(engine)
    ids = context_ids(engine.tokenizer, PROMPTS[1])
    fed, _ = engine.loop.thinker(ids, MAX)
    j = next(j for j in range(5, MAX) if fed[j] not in fed[:j])  # predicted after j fed tokens, not before
    prefill = lambda: engine.model.prefill(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.bool))  # noqa: E731
    for end, max_tokens, want in ((fed[j], MAX, j), (-1, 3, 3), (-1, 1, 1)):
        got, context = think_decode(engine.model, engine.head, prefill(), start, end, max_tokens)
        assert got == fed[:want] == direct_decode(reference, ids, start, end, max_tokens), (end, max_tokens)
        assert context.mask.shape[1] == len(ids) + want


def test_think_puts_each_prompts_tokens_after_its_context_decoded_once_a_prompt(engine, monkeypatch):
    calls = []
    thinker = engine.loop.thinker
    monkeypatch.setattr(engine.loop, "thinker", lambda ids, n: calls.append(n) or thinker(ids, n))
    out = TrajectoryBatch.from_dict(engine.generate(PROMPTS, 2, THINK, seeds=SEEDS))
    assert calls == [MAX, MAX]
    for row, mask, group in zip(out.prompt_ids, out.prompt_mask, out.group_ids):
        ids = context_ids(engine.tokenizer, PROMPTS[group])
        assert list(row[mask]) == ids + thinker(ids, MAX)[0] and not mask[int(mask.sum()):].any()
    plain = TrajectoryBatch.from_dict(engine.generate(PROMPTS, 2, SAMPLING, seeds=SEEDS))
    assert not np.array_equal(out.latents, plain.latents)  # the images see the think tokens
    np.testing.assert_array_equal(out.step_index, plain.step_index)  # ... in the same windows


def test_think_off_is_the_plain_loop_byte_for_byte(engine, monkeypatch):
    """think False (any max_think_tokens) or absent: the trajectories of the loop without a thinker, and the decode
    never runs."""
    monkeypatch.setattr(engine.loop, "thinker", lambda *a: pytest.fail("think off ran a think decode"))
    absent = engine.generate(PROMPTS, 2, SAMPLING, seeds=SEEDS)
    off = engine.generate(PROMPTS, 2, dict(SAMPLING, think=False, max_think_tokens=1), seeds=SEEDS)
    sp = dataclasses.replace(SP, keep_final=True)
    plain = BagelSamplingLoop(engine.model).generate([context_ids(engine.tokenizer, p) for p in PROMPTS], 2, sp,
                                                     seeds=SEEDS, prompts=PROMPTS).to_dict()
    for key, value in plain.items():
        for other in (absent, off):
            if isinstance(value, np.ndarray):
                assert other[key].dtype == value.dtype and np.array_equal(other[key], value), key
            else:
                assert other[key] == value, key


@pytest.mark.parametrize("sampling, needle", [(dict(think="yes"), "think must be a bool"),
                                              (dict(think=True, max_think_tokens=0), "max_think_tokens an int >= 1")])
def test_bad_think_parameters_are_refused(engine, sampling, needle):
    with pytest.raises(ValueError, match=needle):
        engine.generate(PROMPTS[:1], 1, dict(SAMPLING, **sampling))
    with pytest.raises(ValueError, match="think mode needs a thinker"):
        BagelSamplingLoop(engine.model).generate([[1, 2]], 1, dataclasses.replace(SP, think=True))


def bagel_config():
    cfg = config_module(ROOT / "configs" / "tiny_bagel_ocr.py").get_config()
    cfg.data.train, cfg.data.test = str(ROOT / cfg.data.train), str(ROOT / cfg.data.test)
    return cfg


@pytest.mark.parametrize("family, key, value, needle", [
    ("qwen_image", "think", True, "config.sample.think: True is BAGEL's think mode; model.family='qwen_image' has "
                                  "none: pass --config.sample.think=False"),
    ("bagel", "max_think_tokens", 0, "config.sample.max_think_tokens: 0 must be an int >= 1"),
    ("qwen_image", "max_think_tokens", -5, "config.sample.max_think_tokens: -5 must be an int >= 1")])
def test_the_config_refuses_think_outside_bagel_and_a_cap_below_one(family, key, value, needle):
    cfg = bagel_config() if family == "bagel" else recipes.tiny(recipes.base())
    config_lib.validate(cfg)
    cfg.sample[key] = value
    with pytest.raises(UserError) as err:
        config_lib.validate(cfg)
    assert str(err.value).startswith(needle) and "\n" not in str(err.value)


def test_think_pads_prompt_ids_to_the_prompt_and_the_think_cap_and_reaches_the_rollout():
    cfg = bagel_config()
    s = cfg.sample
    assert derived.text_tokens(cfg) == (s.max_sequence_length, s.max_sequence_length)
    assert "sample.think" in recipes.HELP and not s.think and s.max_think_tokens == 1000  # off; vLLM-Omni's cap
    s.think, s.max_think_tokens = True, 24
    config_lib.validate(cfg)
    assert derived.text_tokens(cfg) == (s.max_sequence_length + 24, s.max_sequence_length)
    for eval_mode in (False, True):  # the evals sample the same policy: the same context
        assert {k: v for k, v in families.of(cfg).sampling(cfg, eval_mode).items() if "think" in k} == {
            "think": True, "max_think_tokens": 24}
    err = text_length_error(TextLengthError("prompt_ids", 160, s.max_sequence_length + 24), cfg)
    assert str(err) == (f"prompt_ids has 160 tokens > {s.max_sequence_length + 24} (sample.max_sequence_length="
                        f"{s.max_sequence_length} + sample.max_think_tokens): raise --config.sample.max_sequence_length "
                        f"(or shorten the prompt)")
