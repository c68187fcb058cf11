"""The tiny random BAGEL folder (jaxflow_bridge/rollout/tiny_bagel.py, docs/bagel.md §6): files, loading into
BagelTorch, determinism, tokenizer, a finite velocity."""
import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
from safetensors.torch import load_file

from jaxflow_bridge.contract.bagel_keymap import IGNORED_PREFIXES
from jaxflow_bridge.rollout import tiny_bagel
from jaxflow_bridge.rollout.bagel_torch import BagelTorch


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("bagel") / "seed0"
    tiny_bagel.main(["--out", str(out)])  # also covers the CLI
    return out


@pytest.fixture(scope="module")
def model(folder):
    m = BagelTorch(**tiny_bagel.bagel_torch_fields(folder))
    m.load_checkpoint(load_file(folder / "ema.safetensors"))
    return m


def test_folder_has_every_file_and_the_tiny_sizes(folder):
    assert {p.name for p in folder.iterdir()} == set(tiny_bagel.FILES)
    llm = json.loads((folder / "llm_config.json").read_text())
    top = json.loads((folder / "config.json").read_text())
    vit = json.loads((folder / "vit_config.json").read_text())
    assert {k: llm[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                "num_key_value_heads", "vocab_size", "rope_theta", "rms_norm_eps")} == dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=384, rope_theta=1e6, rms_norm_eps=1e-6)
    assert (top["visual_gen"], top["visual_und"], top["latent_patch_size"], top["max_latent_size"]) == (True, False, 2, 32)
    assert top["vae_config"] == {"z_channels": 16, "downsample": 8} and top["llm_config"] == llm
    assert (vit["num_hidden_layers"], vit["hidden_size"], vit["patch_size"]) == (1, 32, 14) and top["vit_config"] == vit


def test_checkpoint_loads_with_nothing_missing_or_unexpected(folder):
    sd = load_file(folder / "ema.safetensors")
    model = BagelTorch(**tiny_bagel.bagel_torch_fields(folder))
    model.load_checkpoint(sd)  # raises on a missing, unexpected or misshapen tensor
    ignored = {k for k in sd if k.startswith(IGNORED_PREFIXES)}
    assert set(sd) == set(model.state_dict()) | ignored
    for prefix in IGNORED_PREFIXES:  # the ViT, connector, LM head, ... are in the file (BagelPipeline loads them)
        assert any(k.startswith(prefix) for k in ignored), prefix
    assert sd["vit_model.vision_model.embeddings.patch_embedding.weight"].shape == (32, 3, 14, 14)
    assert sd["connector.fc1.weight"].shape == (64, 32) and sd["vit_pos_embed.pos_embed"].shape == (64, 64)
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd[k].float()), k


def test_same_seed_same_tensors_other_seed_and_dtype(folder, tmp_path):
    first = load_file(folder / "ema.safetensors")
    again = tiny_bagel.weights(seed=0)
    assert sorted(first) == sorted(again)
    assert [k for k in first if not torch.equal(first[k], again[k])] == []
    other = tiny_bagel.build_tiny_bagel(tmp_path / "seed1", seed=1)
    second = load_file(other / "ema.safetensors")
    same = [k for k in first if torch.equal(first[k], second[k])]
    assert set(same) == {"latent_pos_embed.pos_embed", "vit_pos_embed.pos_embed"}  # the fixed sin-cos tables
    bf16 = tiny_bagel.weights(seed=0, dtype="bfloat16")
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, first[k].to(torch.bfloat16)) for k, v in bf16.items())
    with pytest.raises(ValueError, match="dtype must be one of"):
        tiny_bagel.weights(dtype="float16")


def test_tokenizer_special_tokens_and_round_trip(folder):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    vocab_size = json.loads((folder / "llm_config.json").read_text())["vocab_size"]
    ids = {}
    for name in ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|endoftext|>"):
        enc = tok.encode(name, add_special_tokens=False)
        assert len(enc) == 1 and 0 <= enc[0] < vocab_size, (name, enc)
        ids[name] = enc[0]
    assert len(set(ids.values())) == len(ids)
    fields = tiny_bagel.bagel_torch_fields(folder)
    assert (fields["vision_start_id"], fields["vision_end_id"]) == (ids["<|vision_start|>"], ids["<|vision_end|>"])
    prompt = "<|im_start|>user\nA red fox, jumping over 2 lazy dogs!<|im_end|>"
    enc = tok.encode(prompt, add_special_tokens=False)
    assert max(enc) < vocab_size and tok.decode(enc) == prompt
    assert enc[0] == ids["<|im_start|>"] and enc[-1] == ids["<|im_end|>"]


def test_velocity_is_finite_with_the_expected_shape(folder, model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([tok.encode("<|im_start|>user\na red fox<|im_end|>", add_special_tokens=False)])
    ctx = model.prefill(ids, torch.ones_like(ids, dtype=torch.bool))
    grid = (4, 6)  # 64 x 96 px
    x = torch.randn(2, grid[0] * grid[1], 64, generator=torch.Generator().manual_seed(0))
    ctx2 = type(ctx)(tuple(k.expand(2, -1, -1, -1) for k in ctx.keys), tuple(v.expand(2, -1, -1, -1)
                                                                             for v in ctx.values), ctx.mask.expand(2, -1))
    v = model.velocity(x, torch.tensor([1.0, 0.5]), ctx2, grid)
    assert v.shape == (2, 24, 64) and v.dtype == torch.float32 and torch.isfinite(v).all()
    assert v.abs().max() > 0 and not torch.equal(v[0], v[1])


def test_cached_path_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXFLOW_CACHE", str(tmp_path))
    path = tiny_bagel.tiny_bagel_path(seed=0)
    assert path.parent == tmp_path and (path / "ema.safetensors").is_file()
    stamp = (path / "ema.safetensors").stat().st_mtime_ns
    assert tiny_bagel.tiny_bagel_path(seed=0) == path and (path / "ema.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary folder left behind
