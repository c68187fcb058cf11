"""The mini OCR proof's model side at toy size: the VAE trains, the folder builds and encodes, flow-matching
pretraining lowers its loss, and the saved folder loads in the torch rollout and the JAX trainer alike."""
import json

import numpy as np
import pytest

from jaxflow.config.validation import config_module
from experiments.mini_ocr.folder import build_folder, encode_text
from experiments.mini_ocr.render import render_dataset
from experiments.mini_ocr.vae import build_vae, pack, posterior_means, train_vae
from experiments.mini_ocr.words import prompt, split
from tests.helpers import ROOT

WORDS = split(4000, 200)[0][:8]


def mini_config(variant=""):
    return config_module(ROOT / "configs" / "mini_ocr.py").get_config(variant)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A toy folder (8-channel VAE trained 6 steps, one-block transformer) and its encoded data."""
    import torch

    from jaxflow_bridge.families.qwen_image.diffusers_pipeline import RolloutPipeline

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("mini")
    images, index = render_dataset(WORDS, 1)
    vae = build_vae(base_dim=8)
    losses = train_vae(vae, images, 6, batch_size=4, lr=2e-3, log=lambda *_: None)
    build_folder(out / "pipeline", vae, "toy")
    pipe = RolloutPipeline.from_pretrained(out / "pipeline", "float32", "cpu")
    data = out / "data"
    data.mkdir()
    np.savez(data / "text.npz", **encode_text(pipe, [prompt(w) for w in WORDS]))
    np.save(data / "latents.npy", pack(posterior_means(pipe.vae, images), pipe.vae))
    np.save(data / "index.npy", index)
    return out, losses


@pytest.mark.slow
def test_vae_loss_drops_and_latents_pack_to_the_transformer_input(toy):
    out, losses = toy
    assert np.mean(losses[-2:]) < losses[0]
    latents = np.load(out / "data" / "latents.npy")
    assert latents.shape == (8, 8 * 16, 64) and np.isfinite(latents).all()
    text = np.load(out / "data" / "text.npz")
    assert text["embeds"].shape[:2] == text["mask"].shape and text["neg_mask"].sum() >= 1
    assert text["mask"].sum(1).min() > text["neg_mask"].sum()  # a sign prompt has more tokens than " "
    assert text["mask"].sum(1).max() <= mini_config().sample.max_sequence_length


def test_the_rl_config_and_its_control_validate(tiny_path):
    from jaxflow.config.errors import UserError
    from jaxflow.config.validation import validate

    for variant, reward in (("", "ocr"), ("control", "ocr_shuffled")):
        cfg = mini_config(variant)
        assert list(cfg.reward.fns) == [reward]
        with pytest.raises(UserError, match="model.path"):
            validate(cfg)
        cfg.model.path = str(tiny_path)
        validate(cfg)
    with pytest.raises(ValueError, match="control"):
        mini_config("typo")


def test_the_awm_arm_leaves_its_micro_batch_to_the_plan(tiny_path):
    """AWM updates once on all 192 samples: with num_micro_batches as set (1) it did not fit a 0.2 JAX pool."""
    from jaxflow.config.validation import validate

    cfg = mini_config("awm")
    assert cfg.train.num_micro_batches == "auto" and cfg.train.num_mini_batches == 1
    cfg.model.path = str(tiny_path)
    validate(cfg)


@pytest.mark.slow
def test_pretraining_lowers_the_loss_and_both_sides_load_the_folder(toy):
    import jax

    from experiments.mini_ocr.pretrain import pretrain
    from jaxflow.families.qwen_image.loading import fingerprint, load_transformer
    from jaxflow_bridge.families.qwen_image.diffusers_pipeline import RolloutPipeline
    from jaxflow_bridge.rollout.sampling import SamplingParams

    out, _ = toy
    folder = out / "pipeline"
    before = RolloutPipeline.from_pretrained(folder, "float32", "cpu").fingerprint
    hist = pretrain(folder, out / "data", steps=40, batch=8, lr=2e-3, dtype="float32", ema_decay=0.5,
                    log_every=10, log=lambda *_: None)
    assert hist[-1]["loss"] < 0.8 * hist[0]["loss"], hist
    pipe = RolloutPipeline.from_pretrained(folder, "float32", "cpu")
    assert pipe.fingerprint != before  # the rollout serves the pretrained weights
    assert pipe.fingerprint == fingerprint(load_transformer(folder / "transformer"))
    assert json.loads((folder / "transformer" / "config.json").read_text())["num_layers"] == 1
    sampling = SamplingParams(height=64, width=128, num_inference_steps=2, max_sequence_length=32, sde_type="ode",
                              noise_level=0.0, sde_window_size=None, true_cfg_scale=4.0)
    images = pipe.generate([prompt(WORDS[0])], 1, sampling, [0]).images
    assert images.shape == (1, 64, 128, 3)
    del jax


def test_the_fp8_arm_differs_from_the_bf16_vllm_omni_arm_in_the_rollout_quantization_alone(tiny_path):
    from jaxflow.config import plan
    from jaxflow.config.recipes import config_keys, config_value
    from jaxflow.config.validation import validate

    cfgs = {v: mini_config(v) for v in ("", "omni", "omni_fp8", "omni_fp8_control")}
    for cfg in cfgs.values():
        cfg.model.path = str(tiny_path)
        validate(cfg)

    def differ(a, b):
        return {k for k in config_keys(cfgs[a]) if config_value(cfgs[a], k) != config_value(cfgs[b], k)}

    assert differ("omni", "omni_fp8") == {"rollout.quantization", "run_dir"}
    assert cfgs["omni_fp8"].rollout.quantization == "fp8" and cfgs["omni"].rollout.quantization == "none"
    assert differ("", "omni") == {"rollout.engine", "rollout.dtype", "rollout.layout", "rollout.lora_apply", "run_dir"}
    assert cfgs["omni"].rollout.engine == "vllm_omni" and cfgs["omni"].rollout.dtype == "bfloat16"
    assert plan.lora_apply(cfgs["omni"]) == plan.lora_apply(cfgs["omni_fp8"]) == "layers"
    assert differ("omni_fp8", "omni_fp8_control") == {"reward.fns", "run_dir"}


def test_the_bf16_copy_holds_the_folder_rounded_to_bf16_and_loads(tmp_path):
    import torch
    from safetensors.torch import load_file

    from experiments.mini_ocr.folder import bf16_copy
    from jaxflow_bridge.families.qwen_image.diffusers_pipeline import RolloutPipeline

    folder = build_folder(tmp_path / "pipeline", build_vae(base_dim=8), "toy")
    copy = bf16_copy(folder, tmp_path / "pipeline_bf16")
    for part in ("transformer/diffusion_pytorch_model", "vae/diffusion_pytorch_model", "text_encoder/model"):
        src, dst = (load_file(f / f"{part}.safetensors") for f in (folder, copy))
        assert src.keys() == dst.keys() and {t.dtype for t in dst.values()} == {torch.bfloat16}, part
        assert all(torch.equal(src[k].to(torch.bfloat16), dst[k]) for k in src), part
    assert json.loads((copy / "vae" / "config.json").read_text())["temperal_downsample"] == [False, True]  # factor 4
    pipe = RolloutPipeline.from_pretrained(copy, "float32", "cpu")
    assert pipe.encode(["a sign"])[0].shape[-1] == 64
