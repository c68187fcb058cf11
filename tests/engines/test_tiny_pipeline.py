"""The tiny offline Qwen-Image pipeline folder: determinism, loading, generation, tokenizer, caching."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest
import torch
from safetensors import safe_open

from jaxflow_bridge.families.qwen_image import tiny

PROMPTS = ["a red fox", "a red fox jumping over the lazy dog"]
NEGATIVES = ["bad quality", "blurry"]
# The real Qwen2 tokenisation of the template prefix (diffusers drops exactly these 34 tokens).
REAL_PREFIX_TOKENS = [
    "<|im_start|>", "system", "Ċ", "Describe", "Ġthe", "Ġimage", "Ġby", "Ġdetailing", "Ġthe", "Ġcolor", ",",
    "Ġshape", ",", "Ġsize", ",", "Ġtexture", ",", "Ġquantity", ",", "Ġtext", ",", "Ġspatial", "Ġrelationships",
    "Ġof", "Ġthe", "Ġobjects", "Ġand", "Ġbackground", ":", "<|im_end|>", "Ċ", "<|im_start|>", "user", "Ċ",
]
SUFFIX_TOKENS = ["<|im_end|>", "Ċ", "<|im_start|>", "assistant", "Ċ"]


def _files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _load(path, dtype=torch.float32):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(path, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny.build_tiny_pipeline(tmp_path_factory.mktemp("tiny") / "seed0")


@pytest.fixture(scope="module")
def pipe(tiny_dir):
    return _load(tiny_dir)


def test_build_is_deterministic_and_seeded(tiny_dir, tmp_path):
    tiny.main(["--out", str(tmp_path / "again"), "--seed", "0"])  # also covers the CLI
    first, again = _files(tiny_dir), _files(tmp_path / "again")
    assert sorted(first) == sorted(again)
    assert {"model_index.json", "transformer/diffusion_pytorch_model.safetensors", "vae/config.json",
            "text_encoder/config.json", "tokenizer/tokenizer.json", "scheduler/scheduler_config.json"} <= set(first)
    assert [k for k in first if first[k] != again[k]] == []

    other = tiny.build_tiny_pipeline(tmp_path / "seed1", seed=1)
    name = "transformer/diffusion_pytorch_model.safetensors"
    assert (other / name).read_bytes() != first[name]


def test_tokenizer_prefix_is_34_real_tokens(pipe):
    tok = pipe.tokenizer
    prefix = tiny.PROMPT_TEMPLATE.split("{}")[0]
    ids = tok(prefix).input_ids
    assert len(ids) == tiny.TEMPLATE_DROP == pipe.prompt_template_encode_start_idx == 34
    assert tok.convert_ids_to_tokens(ids) == REAL_PREFIX_TOKENS
    assert tok(tiny.PROMPT_TEMPLATE.format("")).input_ids[:34] == ids
    assert max(tok.get_vocab().values()) < pipe.text_encoder.config.text_config.vocab_size
    assert tok.pad_token == "<|endoftext|>" and tok.padding_side == "right"


def test_template_drop_keeps_prompt_and_suffix(pipe):
    tok, prompt = pipe.tokenizer, "a red fox"
    full = tok(tiny.PROMPT_TEMPLATE.format(prompt)).input_ids
    prompt_ids = tok(prompt).input_ids
    assert full[34:] == prompt_ids + tok.convert_tokens_to_ids(SUFFIX_TOKENS)
    embeds, mask = pipe._get_qwen_prompt_embeds(prompt, device="cpu")
    assert embeds.shape == (1, len(prompt_ids) + 5, 64) and bool(mask.all())


def test_encode_prompt_mask_and_cfg(pipe):
    pos, pos_mask = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=64)
    neg, _ = pipe.encode_prompt(NEGATIVES, device="cpu", max_sequence_length=64)
    lengths = pos_mask.sum(1).tolist()
    assert pos_mask is not None and lengths[0] < lengths[1] == pos.shape[1]
    assert torch.all(pos[0, lengths[0]:] == 0)
    n = min(pos.shape[1], neg.shape[1])
    assert not torch.allclose(pos[:, :n], neg[:, :n])


def test_generate_with_true_cfg(pipe):
    images = pipe(
        prompt=PROMPTS, negative_prompt=NEGATIVES, true_cfg_scale=4.0, num_inference_steps=2, height=40, width=72,
        max_sequence_length=64, output_type="np", generator=torch.manual_seed(0),
    ).images
    assert images.shape == (2, 40, 72, 3)
    assert np.isfinite(images).all() and images.std() > 0
    assert pipe.scheduler.config.shift_terminal == 0.02 and pipe.scheduler.config.use_dynamic_shifting


def test_bf16_folder_generates(tmp_path):
    path = tiny.build_tiny_pipeline(tmp_path / "bf16", dtype="bfloat16")
    with safe_open(path / "transformer/diffusion_pytorch_model.safetensors", "pt") as f:
        assert all(f.get_slice(k).get_dtype() == "BF16" for k in f.keys())
    pipe = _load(path, torch.bfloat16)
    assert pipe.transformer.dtype == pipe.text_encoder.dtype == pipe.vae.dtype == torch.bfloat16
    # 2 steps: with one step, shift_terminal divides 0 by 0 in diffusers' scheduler (NaN sigmas).
    images = pipe(
        prompt="a red fox", negative_prompt="blurry", true_cfg_scale=4.0, num_inference_steps=2, height=40,
        width=72, output_type="np", generator=torch.manual_seed(0),
    ).images
    assert images.shape == (1, 40, 72, 3) and np.isfinite(images).all()


def test_tiny_pipeline_path_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXFLOW_CACHE", str(tmp_path))
    builds = []
    real_build = tiny.build_tiny_pipeline
    monkeypatch.setattr(tiny, "build_tiny_pipeline", lambda *a, **k: builds.append(a) or real_build(*a, **k))

    path = tiny.tiny_pipeline_path(seed=3)
    assert path.parent == tmp_path and "seed3" in path.name and "float32" in path.name
    assert (path / "model_index.json").is_file() and len(builds) == 1
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp folder left behind
    mtime = (path / "model_index.json").stat().st_mtime_ns

    assert tiny.tiny_pipeline_path(seed=3) == path
    assert len(builds) == 1 and (path / "model_index.json").stat().st_mtime_ns == mtime
