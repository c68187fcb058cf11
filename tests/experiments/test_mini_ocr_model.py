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
