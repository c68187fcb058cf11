"""jaxflow_bridge.rollout: the diffusers rollout pipeline, LoRA application and the Ray server, on the tiny pipeline."""

import ast
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

import jaxflow_bridge.rollout
from jaxflow_bridge.contract.lora_payload import LoRAPayload
from jaxflow_bridge.contract.schedule import sigma_schedule
from jaxflow_bridge.contract.served import ServedProbe, differing
from jaxflow_bridge.contract.trajectory import TrajectoryBatch
from jaxflow_bridge.families.qwen_image.diffusers_pipeline import RolloutPipeline
from jaxflow_bridge.rollout.sampling import DECODE_PIXELS, Fp32Timestep, SamplingParams, cfg_combine, decode_batch
from jaxflow_bridge.rollout.sde import sde_step
from jaxflow_bridge.rollout.server import create_rollout_server
from tests.helpers import expected_served, make_adapter

PROMPTS = ["a red fox", "a red fox jumping over the lazy dog"]
SAMPLING = dict(height=40, width=72, num_inference_steps=4, true_cfg_scale=4.0, noise_level=1.2, sde_window_size=2,
                sde_window_range=(0, 3), max_sequence_length=64)
SEEDS = [10, 11, 12, 13]
GRID, S, C, W = (5, 9), 45, 64, 2  # a 40x72 image is a 5x9 packed grid with the tiny VAE (factor 4)
SAMPLING_HW = (SAMPLING["height"], SAMPLING["width"])
NO_CFG = SamplingParams(**{**SAMPLING, "true_cfg_scale": 1.0, "num_inference_steps": 3})


@pytest.fixture(scope="module")
def pipe(tiny_path):
    return RolloutPipeline.from_pretrained(tiny_path, dtype="float32", device="cpu")


@pytest.fixture
def fresh_pipe(tiny_path):
    """A pipeline of its own, for tests that change its LoRA adapter."""
    return RolloutPipeline.from_pretrained(tiny_path, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def batch(pipe):
    return pipe.generate(PROMPTS, 2, SamplingParams(**SAMPLING), seeds=SEEDS)


# ---------------------------------------------------------------------------------------------- pipeline


def test_trajectory_contract(pipe, batch):
    b = len(SEEDS)
    assert batch.images.shape == (b, 40, 72, 3) and batch.images.dtype == np.uint8
    assert batch.latents.shape == (b, W + 1, S, C) and batch.latents.dtype == np.float32
    assert batch.log_probs.shape == (b, W) and batch.log_probs.dtype == np.float32
    np.testing.assert_array_equal(batch.sigmas, sigma_schedule(pipe.scheduler_config, 4, S))
    starts = batch.step_index[:, 0]
    assert set(starts.tolist()) == {0, 1}  # windows differ per sample
    np.testing.assert_array_equal(batch.step_index, starts[:, None] + np.arange(W))
    assert batch.prompts == (PROMPTS[0],) * 2 + (PROMPTS[1],) * 2
    assert batch.group_ids.tolist() == [0, 0, 1, 1] and batch.seeds.tolist() == SEEDS
    assert batch.policy_versions.tolist() == [0] * b
    # the pre-window latent of a window starting at step 0 is the sample's initial noise
    for i in np.flatnonzero(starts == 0):
        noise = torch.randn(S, C, generator=torch.Generator().manual_seed(SEEDS[i]))
        np.testing.assert_array_equal(batch.latents[i, 0], noise.numpy())
    # text: the template drop leaves prompt tokens + 5 suffix tokens, right-padded with a False mask
    lengths = [len(pipe.tokenizer(pipe.template.format(p)).input_ids) - 34 for p in PROMPTS]
    assert batch.prompt_mask.sum(1).tolist() == [lengths[0]] * 2 + [lengths[1]] * 2
    assert batch.prompt_embeds.shape == (b, max(lengths), 64) and not batch.prompt_embeds[0, lengths[0]:].any()
    encoded = pipe.encode(PROMPTS)
    np.testing.assert_array_equal(batch.prompt_embeds[3], encoded[1].numpy())
    assert batch.negative_prompt_mask.all() and batch.negative_prompt_embeds.shape[0] == b
    assert np.isfinite(batch.log_probs).all() and not np.array_equal(batch.latents[:, 0], batch.latents[:, 1])


def test_sampling_log_probs_match_the_step_std(batch):
    """At sampling time E[log p] = -0.5 - log(step_std) - log sqrt(2 pi) (mean over 2880 latent elements)."""
    sig, idx = batch.sigmas, batch.step_index
    s, s_next = sig[idx], sig[idx + 1]
    std = 1.2 * np.sqrt(s / (1 - np.where(s == 1, sig[1], s))) * np.sqrt(s - s_next)
    np.testing.assert_allclose(batch.log_probs, -0.5 - np.log(std) - 0.9189, atol=0.08)


def test_replaying_the_window_gives_ratio_one(pipe, batch):
    """Recomputing v from the stored latents and text gives the stored log-probs (the trainer's path)."""
    text = [torch.from_numpy(a) for a in (batch.prompt_embeds, batch.prompt_mask, batch.negative_prompt_embeds,
                                          batch.negative_prompt_mask)]
    for k in range(W):
        x = torch.from_numpy(batch.latents[:, k])
        sigma, sigma_next = batch.sigmas[batch.step_index[:, k]], batch.sigmas[batch.step_index[:, k] + 1]
        v = pipe.velocity(x, sigma, *text, true_cfg_scale=4.0, grid=GRID)
        _, log_prob, _, _ = sde_step(x, v, sigma, sigma_next, batch.sigmas[1], sde_type="sde", noise_level=1.2,
                                     prev_sample=torch.from_numpy(batch.latents[:, k + 1]))
        np.testing.assert_allclose(log_prob.numpy(), batch.log_probs[:, k], atol=1e-5)


def test_cfg_combine_is_the_norm_rescaled_guidance_formula():
    rng = np.random.default_rng(0)
    pos, neg = rng.standard_normal((2, 3, 5, 16))
    comb = neg + 4.0 * (pos - neg)
    want = comb * np.linalg.norm(pos, axis=-1, keepdims=True) / np.linalg.norm(comb, axis=-1, keepdims=True)
    got = cfg_combine(torch.from_numpy(pos).float(), torch.from_numpy(neg).float(), 4.0)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


def test_cfg_velocity_combines_the_positive_and_negative_velocities(pipe, batch):
    """velocity with true CFG is cfg_combine of the velocities of each text alone (batched call: to float32
    rounding of the padded rows)."""
    x, sigma = torch.from_numpy(batch.latents[:, 0]), batch.sigmas[batch.step_index[:, 0]]
    pos, pos_mask, neg, neg_mask = (torch.from_numpy(a) for a in (
        batch.prompt_embeds, batch.prompt_mask, batch.negative_prompt_embeds, batch.negative_prompt_mask))
    v = pipe.velocity(x, sigma, pos, pos_mask, neg, neg_mask, true_cfg_scale=4.0, grid=GRID)
    v_pos = pipe.velocity(x, sigma, pos, pos_mask, grid=GRID)
    v_neg = pipe.velocity(x, sigma, neg, neg_mask, grid=GRID)
    np.testing.assert_allclose(v.numpy(), cfg_combine(v_pos, v_neg, 4.0).numpy(), atol=1e-5)


def test_equal_seeds_are_deterministic_and_base_seed_counts_up(pipe):
    first = pipe.generate(PROMPTS[:1], 2, NO_CFG, seeds=3)
    again = pipe.generate(PROMPTS[:1], 2, NO_CFG, seeds=[3, 4])
    other = pipe.generate(PROMPTS[:1], 2, NO_CFG, seeds=[5, 6])
    assert first.seeds.tolist() == [3, 4] and first.negative_prompt_embeds is None  # no negative without CFG
    for field in ("images", "latents", "log_probs", "step_index"):
        np.testing.assert_array_equal(getattr(first, field), getattr(again, field))
    assert not np.allclose(first.latents, other.latents)


def test_batched_equals_separate_calls_with_cfg(pipe):
    sampling = SamplingParams(**SAMPLING)
    batched = pipe.generate(PROMPTS[1:], 2, sampling, seeds=[21, 22])
    for j, seed in enumerate([21, 22]):
        one = pipe.generate(PROMPTS[1:], 1, sampling, seeds=[seed])
        np.testing.assert_allclose(one.latents[0], batched.latents[j], atol=1e-5)
        np.testing.assert_allclose(one.log_probs[0], batched.log_probs[j], atol=1e-5)
        np.testing.assert_array_equal(one.step_index[0], batched.step_index[j])
        assert np.abs(one.images[0].astype(int) - batched.images[j]).max() <= 1


def test_split_cfg_forward_equals_batched_and_runs_each_text_unpadded(fresh_pipe):
    """cfg_forward="split": per step one forward over the positives at their own padded length and one over the
    negatives at theirs, instead of one over both padded to the longer; the same trajectories to float32 rounding
    (the tolerance of the batched-vs-separate test above: the same sums over differently shaped batches)."""
    sampling = SamplingParams(**SAMPLING)
    batched = fresh_pipe.generate(PROMPTS, 2, sampling, seeds=SEEDS)
    calls = []
    hook = fresh_pipe.transformer.register_forward_pre_hook(
        lambda m, a, kw: calls.append((kw["hidden_states"].shape[0], kw["encoder_hidden_states_mask"].shape[1],
                                       bool(kw["encoder_hidden_states_mask"].all()))), with_kwargs=True)
    fresh_pipe.cfg_forward = "split"
    try:
        split = fresh_pipe.generate(PROMPTS, 2, sampling, seeds=SEEDS)
    finally:
        hook.remove()
    positive, negative = batched.prompt_mask.shape[1], batched.negative_prompt_mask.shape[1]
    assert positive > negative  # the negative prompt is the shorter text: batched pads it
    assert calls == [(4, positive, False), (4, negative, True)] * SAMPLING["num_inference_steps"]
    for field in ("latents", "log_probs"):
        np.testing.assert_allclose(getattr(split, field), getattr(batched, field), atol=1e-5)
    np.testing.assert_array_equal(split.prompt_embeds, batched.prompt_embeds)
    assert np.abs(split.images.astype(int) - batched.images).max() <= 1


def test_unknown_cfg_forward_is_refused(tiny_path):
    from jaxflow_bridge.engines.diffusers import DiffusersEngine

    with pytest.raises(ValueError, match=r"cfg_forward='fused'; choose one of \('split', 'batched'\)"):
        DiffusersEngine({"engine": "diffusers", "model": str(tiny_path), "cfg_forward": "fused"})


def test_engine_returns_text_padded_to_the_steps_text_tokens_with_the_same_numbers(tiny_path):
    """A rollout call's trajectory arrives from the engine padded to `text_tokens` (the train step's one text
    shape), before any concat; the forwards ran on the request's own text: the same samples as without. A text
    longer than `text_tokens` is a TextLengthError naming the field."""
    from jaxflow_bridge.contract.trajectory import TextLengthError
    from jaxflow_bridge.engines.diffusers import DiffusersEngine

    engine = DiffusersEngine({"engine": "diffusers", "model": str(tiny_path), "dtype": "float32", "device": "cpu"})
    sampling = {**SAMPLING, "num_inference_steps": 3, "sde_window_range": (0, 2)}
    plain = TrajectoryBatch.from_dict(engine.generate(PROMPTS, 2, sampling, SEEDS))
    padded = TrajectoryBatch.from_dict(engine.generate(PROMPTS, 2, {**sampling, "text_tokens": (64, 40)}, SEEDS))
    assert padded.prompt_embeds.shape[:2] == padded.prompt_mask.shape == (4, 64)
    assert padded.negative_prompt_embeds.shape[:2] == padded.negative_prompt_mask.shape == (4, 40)
    for prefix in ("prompt", "negative_prompt"):
        text, mask = getattr(plain, f"{prefix}_embeds"), getattr(plain, f"{prefix}_mask")
        length = text.shape[1]
        np.testing.assert_array_equal(getattr(padded, f"{prefix}_embeds")[:, :length], text)
        np.testing.assert_array_equal(getattr(padded, f"{prefix}_mask")[:, :length], mask)
        assert not getattr(padded, f"{prefix}_embeds")[:, length:].any()
        assert not getattr(padded, f"{prefix}_mask")[:, length:].any()
    for field in ("images", "latents", "log_probs"):
        np.testing.assert_array_equal(getattr(padded, field), getattr(plain, field))
    longest = plain.prompt_mask.shape[1]
    with pytest.raises(TextLengthError, match=f"^prompt_embeds has {longest} tokens > {longest - 1}, "):
        engine.generate(PROMPTS, 2, {**sampling, "text_tokens": (longest - 1, 40)}, SEEDS)


def test_same_latent_shares_a_groups_initial_noise_but_not_its_step_noise(pipe):
    """2 prompts x 3 samples, window from step 0 (latents[:, 0] is the initial noise): with same_latent a group
    starts from its first sample's noise, its samples still diverge, and that first sample is unchanged."""
    sampling = {**SAMPLING, "true_cfg_scale": 1.0, "num_inference_steps": 3, "sde_window_size": None}
    seeds = [30, 31, 32, 33, 34, 35]
    shared = pipe.generate(PROMPTS, 3, SamplingParams(**sampling, same_latent=True), seeds=seeds)
    plain = pipe.generate(PROMPTS, 3, SamplingParams(**sampling), seeds=seeds)
    start = shared.latents[:, 0]
    for g in (0, 3):
        np.testing.assert_array_equal(start[g:g + 3], np.broadcast_to(start[g], start[g:g + 3].shape))
        assert not np.allclose(shared.latents[g, -1], shared.latents[g + 1, -1])  # per-sample step noise
        assert not np.array_equal(shared.images[g], shared.images[g + 1])
        assert not np.allclose(plain.latents[g, 0], plain.latents[g + 1, 0])
    assert not np.allclose(start[0], start[3])
    for field in ("latents", "log_probs"):  # a group's first sample: the same bytes in, the same bytes out
        np.testing.assert_array_equal(getattr(shared, field)[::3], getattr(plain, field)[::3])


def test_keep_final_returns_the_latents_the_images_decode_from(pipe):
    """keep_final (DiffusionNFT trains on them): final_latents (B, S, C) float32, the same bytes whatever the flag
    (the flag changes no computation), decoding to the batch's images; absent without it."""
    sampling = {**SAMPLING, "true_cfg_scale": 1.0, "num_inference_steps": 3}
    kept = pipe.generate(PROMPTS, 2, SamplingParams(**sampling, keep_final=True), seeds=[40, 41, 42, 43])
    plain = pipe.generate(PROMPTS, 2, SamplingParams(**sampling), seeds=[40, 41, 42, 43])
    assert plain.final_latents is None and kept.final_latents.shape == (4, *kept.latents.shape[2:])
    np.testing.assert_array_equal(kept.images, plain.images)
    np.testing.assert_array_equal(pipe.decode(torch.from_numpy(kept.final_latents), *SAMPLING_HW),
                                  kept.images)
    joined = TrajectoryBatch.concat([kept, kept])
    np.testing.assert_array_equal(joined.final_latents[4:], kept.final_latents)
    with pytest.raises(ValueError, match="final_latents"):
        TrajectoryBatch.concat([kept, plain])


def test_dpm2_rollout_runs_and_differs_from_euler(pipe):
    """solver='dpm2' (DiffusionNFT's sampler) through the diffusers engine: final latents of the same seeds that
    differ from the Euler ODE's by more than rounding, and log-probs 0."""
    sampling = {**SAMPLING, "sde_type": "ode", "true_cfg_scale": 1.0, "keep_final": True}
    dpm = pipe.generate(PROMPTS, 1, SamplingParams(**sampling, solver="dpm2"), seeds=[7, 8])
    euler = pipe.generate(PROMPTS, 1, SamplingParams(**sampling), seeds=[7, 8])
    assert np.all(np.isfinite(dpm.final_latents)) and not np.any(dpm.log_probs)
    gap = np.abs(dpm.final_latents - euler.final_latents).max()
    assert gap > 1e-3 * np.abs(euler.final_latents).max()


def test_mixgrpo_flash_rollout_keeps_the_window_and_changes_the_steps_after(pipe):
    """solver='dpm2' with the SDE (MixGRPO-Flash) through the diffusers engine, every sample's window [1, 3) as
    MixGRPO narrows it: the window's latents and log-probs equal the Euler rollout's of the same seeds (bit for bit:
    the same steps up to the window's end), the final latents differ (second-order steps 3 and 4)."""
    sampling = {**SAMPLING, "num_inference_steps": 6, "sde_window_range": (1, 3), "true_cfg_scale": 1.0,
                "keep_final": True}
    flash = pipe.generate(PROMPTS, 1, SamplingParams(**sampling, solver="dpm2"), seeds=[7, 8])
    euler = pipe.generate(PROMPTS, 1, SamplingParams(**sampling), seeds=[7, 8])
    assert np.all(flash.step_index == [1, 2])
    np.testing.assert_array_equal(flash.latents, euler.latents)
    np.testing.assert_array_equal(flash.log_probs, euler.log_probs)
    assert np.all(flash.log_probs != 0)
    gap = np.abs(flash.final_latents - euler.final_latents).max()
    assert gap > 1e-3 * np.abs(euler.final_latents).max()


def test_decode_calls_follow_the_pixel_budget(pipe, monkeypatch):
    """Small images decode many to a VAE call (one call for this batch); full-size ones 4 at 512^2, 1 at 1024^2; the
    images do not depend on how the batch was split."""
    assert (decode_batch(512, 512), decode_batch(1024, 1024), decode_batch(64, 128)) == (4, 1, 128)
    latents = torch.randn(5, S, C, generator=torch.Generator().manual_seed(0))
    one_call = pipe.decode(latents, *SAMPLING_HW)
    calls = []
    original = pipe.vae.decode
    monkeypatch.setattr(pipe.vae, "decode", lambda z, **kw: calls.append(len(z)) or original(z, **kw))
    again = pipe.decode(latents, *SAMPLING_HW)
    monkeypatch.setattr("jaxflow_bridge.rollout.sampling.DECODE_PIXELS", 2 * SAMPLING_HW[0] * SAMPLING_HW[1])
    split = pipe.decode(latents, *SAMPLING_HW)
    assert calls == [5, 2, 2, 1] and DECODE_PIXELS // (SAMPLING_HW[0] * SAMPLING_HW[1]) >= 5
    np.testing.assert_array_equal(one_call, again)
    assert np.abs(one_call.astype(int) - split).max() <= 1


def test_ode_rollout_matches_stock_diffusers_pipeline(pipe):
    """With no noise our batched-CFG loop is diffusers' QwenImagePipeline (t/1000 vs sigma: float rounding only)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    sampling = SamplingParams(**{**SAMPLING, "sde_type": "ode", "num_inference_steps": 3})
    ours = pipe.generate(PROMPTS[:1], 1, sampling, seeds=[5])
    stock = QwenImagePipeline(FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler_config), pipe.vae,
                              pipe.text_encoder, pipe.tokenizer, pipe.transformer)
    stock.set_progress_bar_config(disable=True)
    steps = []
    image = stock(PROMPTS[:1], negative_prompt=" ", true_cfg_scale=4.0, height=40, width=72, num_inference_steps=3,
                  latents=torch.randn(1, S, C, generator=torch.Generator().manual_seed(5)), output_type="np",
                  max_sequence_length=64,
                  callback_on_step_end=lambda p, i, t, kw: steps.append(kw["latents"].clone()) or {}).images
    start = ours.step_index[0, 0]
    for k in range(W):
        np.testing.assert_allclose(ours.latents[0, k + 1], steps[start + k][0].numpy(), atol=1e-5)
    assert np.abs(ours.images[0].astype(int) - np.round(image[0] * 255)).max() <= 1


def test_text_tower_encodes_as_the_whole_encoder_without_vision_tower_or_head(tiny_path):
    """The pipeline keeps Qwen2.5-VL's base model only: the same hidden states, bit for bit, as the whole model's
    forward (what diffusers calls), with no vision tower or output head left to hold."""
    from diffusers import QwenImagePipeline

    stock = QwenImagePipeline.from_pretrained(tiny_path, dtype=torch.float32, local_files_only=True)
    whole = stock.text_encoder
    tok = stock.tokenizer([stock.prompt_template_encode.format(t) for t in PROMPTS], padding=True,
                          return_tensors="pt")
    with torch.inference_mode():
        expected = whole(input_ids=tok.input_ids, attention_mask=tok.attention_mask,
                         output_hidden_states=True).hidden_states[-1]
    ours = RolloutPipeline(stock, "cpu")
    names = [n for n, _ in ours.text_encoder.named_parameters()]
    assert names and not [n for n in names if "visual" in n or "lm_head" in n]
    drop = stock.prompt_template_encode_start_idx
    for got, h, m in zip(ours.encode(PROMPTS), expected, tok.attention_mask, strict=True):
        assert torch.equal(got, h[m.bool()][drop:])


def test_bf16_rollout_keeps_latents_fp32_and_embeds_in_model_dtype(tiny_path):
    batch = RolloutPipeline.from_pretrained(tiny_path, dtype="bfloat16", device="cpu").generate(
        PROMPTS[:1], 1, SamplingParams(**{**SAMPLING, "num_inference_steps": 3}), seeds=[0])
    assert batch.latents.dtype == np.float32 and batch.prompt_embeds.dtype.name == "bfloat16"
    assert batch.negative_prompt_embeds.dtype.name == "bfloat16" and np.isfinite(batch.log_probs).all()


def test_rollout_package_never_imports_jax():
    root = Path(jaxflow_bridge.rollout.__file__).parents[1]
    paths = sorted(p for folder in ("rollout", "sync", "engines", "families") for p in (root / folder).rglob("*.py"))
    assert {"diffusers_pipeline.py", "server.py", "layers.py", "diffusers.py"} <= {p.name for p in paths}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not [n for n in names if n.split(".")[0] in ("jax", "flax", "jaxflow")], path


def _transformer(tiny_path, dtype):
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel.from_pretrained(tiny_path / "transformer", dtype=dtype).eval()


def test_fp32_timestep_equals_stock_diffusers_in_fp32_and_skips_bf16_rounding(tiny_path):
    torch.manual_seed(0)
    sigma = torch.tensor([0.7433108, 0.4250384])  # not representable in bf16
    inputs = dict(hidden_states=torch.randn(2, S, C), encoder_hidden_states=torch.randn(2, 7, 64),
                  encoder_hidden_states_mask=torch.ones(2, 7, dtype=torch.bool), img_shapes=[[(1, *GRID)]] * 2,
                  return_dict=False)
    stock, ours = _transformer(tiny_path, torch.float32), _transformer(tiny_path, torch.float32)
    fp32_timestep = Fp32Timestep(ours)
    with torch.no_grad(), fp32_timestep(sigma):
        got = ours(timestep=sigma, **inputs)[0]
    assert torch.equal(got, stock(timestep=sigma, **inputs)[0].detach())

    model = _transformer(tiny_path, torch.bfloat16)
    fp32_timestep, embeds = Fp32Timestep(model), []
    model.time_text_embed.register_forward_hook(lambda m, args, out: embeds.append(out))
    bf16_inputs = {k: v.bfloat16() if torch.is_floating_point(v) else v
                   for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    with torch.no_grad():
        with fp32_timestep(sigma):
            model(timestep=sigma, **{**inputs, **bf16_inputs})
        model(timestep=sigma, **{**inputs, **bf16_inputs})  # outside the context: stock behaviour
        embed = model.time_text_embed
        want = embed.timestep_embedder(embed.time_proj(sigma).bfloat16())
        rounded = embed.timestep_embedder(embed.time_proj(sigma.bfloat16()).bfloat16())
    assert torch.equal(embeds[0], want) and torch.equal(embeds[1], rounded) and not torch.equal(want, rounded)


@pytest.mark.parametrize("change, message", [
    (dict(prompts=[]), "prompts must be a non-empty list of str"),
    (dict(n=0), r"n \(samples per prompt\) must be an int >= 1"),
    (dict(height=44), r"multiples of 8 \(2 x VAE factor 4\), got 44x72"),
    (dict(num_inference_steps=4.0), "height, width and num_inference_steps must be ints"),
    (dict(max_sequence_length=8), r"2 prompt\(s\) exceed max_sequence_length=8 tokens"),
    (dict(negative_prompt="bad " * 40), r"1 prompt\(s\) exceed max_sequence_length=64 .*#2"),
    (dict(max_sequence_length=2000), r"max_sequence_length must be in \[1, 1024\]"),
    (dict(seeds=[1, 2]), r"seeds must be 4 ints"),
    (dict(sde_type="dance"), "sde_type must be one of"),
    (dict(sde_window_size=4), "SDE window size 4 must be in"),
    (dict(same_latent=1), "same_latent must be a bool"),
    (dict(solver="dpm3"), "solver='dpm3'; choose one of"),
    # the rules the config's validation stage checks too, with the same message (tests/config/test_config_stages.py)
    (dict(sde_window_range=(2, 5)), re.escape("SDE window size 2 does not fit in window_range (2, 5) (clipped to "
                                              "[2, 3) so that the last step 3 is excluded)")),
])
def test_invalid_requests_fail_before_any_model_runs(pipe, monkeypatch, change, message):
    def untouchable(*args, **kwargs):
        raise AssertionError("a model ran before validation")

    monkeypatch.setattr(pipe, "encode", untouchable)
    monkeypatch.setattr(pipe, "_denoise", untouchable)
    call = {"prompts": PROMPTS, "n": 2, "seeds": None}
    sampling = SamplingParams(**{**SAMPLING, **{k: v for k, v in change.items() if k not in call}})
    args = {**call, **{k: v for k, v in change.items() if k in call}}
    with pytest.raises(ValueError, match=message):
        pipe.generate(args["prompts"], args["n"], sampling, args["seeds"])


def test_sampling_params_refuse_unknown_keys():
    assert SamplingParams.from_dict({"sde_window_range": [0, 3], "true_cfg_scale": 4.0}).sde_window_range == (0, 3)
    with pytest.raises(ValueError, match=r"unknown sampling parameters \['guidance'\]"):
        SamplingParams.from_dict({"guidance": 3.0})


# ---------------------------------------------------------------------------------------------- LoRA


def test_update_lora_changes_outputs_and_version(fresh_pipe, tmp_path):
    p, args = fresh_pipe, (PROMPTS[:1], 1, NO_CFG, [0])
    base = p.generate(*args)
    tensors, config = make_adapter(p, prefix="transformer.")
    reply = p.update_lora(tensors, 1, config)
    assert (reply["version"], reply["bound_modules"]) == (1, 8)
    assert differing(expected_served(LoRAPayload(1, config, tensors)), ServedProbe.from_dict(reply["served"])) == []
    first = p.generate(*args)
    assert first.policy_versions.tolist() == [1] and not np.allclose(first.latents, base.latents, atol=1e-3)

    layer = p.transformer.get_submodule("transformer_blocks.0.attn.to_q")
    zeros = {k: np.zeros_like(v) for k, v in make_adapter(p)[0].items()}
    reply = p.update_lora(zeros, 2)
    assert (reply["version"], reply["bound_modules"]) == (2, 8)  # config reused, no re-injection
    assert not any(np.any(v) for v in reply["served"]["deltas"].values())
    assert p.transformer.get_submodule("transformer_blocks.0.attn.to_q") is layer
    np.testing.assert_allclose(p.generate(*args).latents, base.latents, atol=1e-6)  # a zero delta is the base

    other, other_config = make_adapter(p, modules=("attn.to_v",), rank=2, seed=1)  # new rank and targets
    save_file(other, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(other_config))
    reply = p.update_lora(str(tmp_path), 3)
    assert (reply["version"], reply["bound_modules"], len(reply["served"]["deltas"])) == (3, 2, 2)
    assert type(p.transformer.get_submodule("transformer_blocks.0.attn.to_q")) is torch.nn.Linear
    assert not np.allclose(p.generate(*args).latents, base.latents, atol=1e-3)


@pytest.mark.slow
def test_compiled_engine_equals_eager_across_lora_updates(fresh_pipe, tiny_path):
    """`compile`: torch.compile of the repeated block (dynamic shapes) gives the eager trajectories, and a LoRA
    update copied into the bound layers reaches the compiled code (no stale weights baked in)."""
    from jaxflow_bridge.engines.diffusers import DiffusersEngine

    engine = DiffusersEngine({"engine": "diffusers", "model": str(tiny_path), "dtype": "float32", "device": "cpu",
                              "compile": True})
    sampling = {**SAMPLING, "num_inference_steps": 3}
    for version, seed in ((1, 0), (2, 1)):
        tensors, config = make_adapter(fresh_pipe, seed=seed)
        engine.update_lora(tensors, version, config)
        fresh_pipe.update_lora(tensors, version, config)
        for prompts in (PROMPTS[:1], PROMPTS):  # two text lengths: one compile serves both
            got = TrajectoryBatch.from_dict(engine.generate(prompts, 1, sampling, SEEDS[:len(prompts)]))
            want = fresh_pipe.generate(prompts, 1, SamplingParams(**sampling), SEEDS[:len(prompts)])
            np.testing.assert_allclose(got.latents, want.latents, atol=1e-5)
            np.testing.assert_allclose(got.log_probs, want.log_probs, atol=1e-5)
            assert got.policy_versions.tolist() == [version] * len(prompts)


def test_bad_adapters_are_refused_and_the_old_one_keeps_serving(fresh_pipe):
    p, args = fresh_pipe, (PROMPTS[:1], 1, NO_CFG, [0])
    good, config = make_adapter(p)
    with pytest.raises(ValueError, match="adapter_config .* is required for the first"):
        p.update_lora(good, 1)
    p.update_lora(good, 1, config)
    before = p.generate(*args)

    bad = dict(good)
    bad["transformer_blocks.0.attn.to_qq.lora_A.weight"] = good["transformer_blocks.0.attn.to_q.lora_A.weight"]
    bad["transformer_blocks.1.attn.to_k.lora_B.weight"] = np.ones((64, 3), np.float32)
    with pytest.raises(ValueError, match="2 offending tensors") as err:
        p.update_lora(bad, 2)
    assert "transformer_blocks.0.attn.to_qq.lora_A.weight: the transformer has no Linear module" in str(err.value)
    assert "transformer_blocks.1.attn.to_k.lora_B.weight: expected shape (64, 4), got (64, 3)" in str(err.value)

    many = {f"transformer_blocks.0.nope{i}.lora_A.weight": np.zeros((4, 64), np.float32) for i in range(25)}
    with pytest.raises(ValueError, match=r"25 offending tensors.*'transformer_blocks.0.nope19'; \.\.\. and 5 more$"):
        p.update_lora(many, 2)
    half = {k: v for k, v in good.items() if "lora_A" in k}
    with pytest.raises(ValueError, match=r"to_q.lora_B.weight: missing"):
        p.update_lora(half, 2)
    with pytest.raises(ValueError, match="expected shape"):  # rank 8 in the config, rank-4 tensors
        p.update_lora(good, 2, {**config, "r": 8})
    with pytest.raises(ValueError, match="r: expected a positive number"):
        p.update_lora(good, 2, {"lora_alpha": 8})
    with pytest.raises(ValueError, match="use_dora: unsupported"):
        p.update_lora(good, 2, {**config, "use_dora": True})
    with pytest.raises(ValueError, match="binds zero modules"):
        p.update_lora({}, 2)

    after = p.generate(*args)
    assert p.policy_version == 1 and after.policy_versions.tolist() == [1]
    np.testing.assert_array_equal(after.latents, before.latents)
    np.testing.assert_array_equal(after.images, before.images)


# ---------------------------------------------------------------------------------------------- Ray server


@pytest.fixture(scope="module")
def servers(ray_session, tiny_path):
    """Two servers started together (no ports, no shared state)."""
    config = {"engine": "diffusers", "model": str(tiny_path), "dtype": "float32", "device": "cpu"}
    handles = [create_rollout_server(config, num_cpus=1) for _ in range(2)]
    yield handles
    for handle in handles:
        ray_session.kill(handle)


@pytest.mark.slow  # starts Ray (the ray_session fixture) and Ray actors
def test_two_servers_start_in_parallel(ray_session, servers, pipe):
    infos = ray_session.get([s.info.remote() for s in servers])
    for info in infos:
        assert info["engine"] == "diffusers" and info["device"] == "cpu" and info["dtype"] == "float32"
        assert info["policy_version"] == 0 and info["fingerprint"] == pipe.fingerprint
        assert info["model"] == infos[0]["model"] and info["size_multiple"] == 8


@pytest.mark.slow  # starts Ray (the ray_session fixture) and Ray actors
def test_server_generate_update_lora_info(ray_session, servers, pipe):
    server, sampling = servers[0], {**SAMPLING, "num_inference_steps": 3}
    out = TrajectoryBatch.from_dict(ray_session.get(server.generate.remote(PROMPTS[:1], 2, sampling, 7)))
    local = pipe.generate(PROMPTS[:1], 2, SamplingParams.from_dict(sampling), 7)
    np.testing.assert_allclose(out.latents, local.latents, atol=1e-4)
    assert out.seeds.tolist() == [7, 8] and out.negative_prompt_embeds is not None

    tensors, config = make_adapter(pipe)
    reply = ray_session.get(server.update_lora.remote(tensors, 5, config))
    assert (reply["version"], reply["bound_modules"], len(reply["served"]["deltas"])) == (5, 8, 8)
    with pytest.raises(ValueError, match="binds zero modules"):
        ray_session.get(server.update_lora.remote({}, 6))
    ray_session.get([server.sleep.remote(), server.wake.remote()])  # no-ops on CPU
    after = TrajectoryBatch.from_dict(ray_session.get(server.generate.remote(PROMPTS[:1], 2, sampling, 7)))
    assert after.policy_version == 5 and not np.allclose(after.latents, out.latents, atol=1e-3)
    info = ray_session.get(server.info.remote())
    assert info["policy_version"] == 5 and info["lora_modules"] == 8 and info["fingerprint"] == pipe.fingerprint


def test_unknown_engine_is_refused_before_ray():
    with pytest.raises(ValueError, match=r"unknown rollout engine 'vllm'; known engines: \['bagel_torch', 'diffusers', 'vllm_omni'\]"):
        create_rollout_server({"engine": "vllm"})
