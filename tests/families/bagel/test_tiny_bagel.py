"""The tiny random BAGEL folder (jaxflow_bridge/families/bagel/tiny.py, docs/bagel.md §6): files, loading into
BagelTorch, determinism, tokenizer, a finite velocity."""
import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
from safetensors.torch import load_file

from jaxflow_bridge.families.bagel.keymap import IGNORED_PREFIXES
from jaxflow_bridge.families.bagel import tiny as tiny_bagel
from jaxflow_bridge.families.bagel.model import BagelTorch


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
    assert (top["visual_gen"], top["visual_und"], top["latent_patch_size"], top["max_latent_size"]) == (True, True, 2, 32)
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


def test_tokenizer_has_the_thinker_placeholders(folder):
    """vLLM-Omni's BAGEL thinker (two-stage deployment) profiles with the dummy text "<|image_pad|>" and
    "<|fim_middle|>" (an image to edit) and needs each to be one token of the vocabulary: a tokenizer without
    "<|fim_middle|>" failed its start on an H200 ("Expected there to be 1 prompt updates corresponding to 1 img2img
    items, but instead found 0"). "<|fim_middle|>" is an added token, not a special one, as in Qwen2.5's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    vocab, vocab_size = tok.get_vocab(), json.loads((folder / "llm_config.json").read_text())["vocab_size"]
    image, edit = vocab["<|image_pad|>"], vocab["<|fim_middle|>"]
    assert max(image, edit) < vocab_size and image != edit
    assert tok.encode("<|image_pad|>" * 2 + "<|fim_middle|>", add_special_tokens=False) == [image, image, edit]
    assert tok.convert_tokens_to_ids("<|fim_middle|>") == edit
    assert "<|fim_middle|>" not in tok.all_special_tokens
    assert tok.decode(tok.encode("a<|fim_middle|>b", add_special_tokens=False), skip_special_tokens=True) == \
        "a<|fim_middle|>b"


def thinker_profile(top: dict) -> tuple[int, int, int]:
    """(tokens of a dummy image, of a dummy image to edit, the last RoPE position of the dummy request after it) in
    vLLM-Omni 0.20's thinker start-up (OmniBagelMultiModalProcessor._get_prompt_updates, _adjust_positions_for_img2img
    over one request of tiny_bagel.THINKER_TOKENS, bagel.yaml's max_num_batched_tokens), from config.json."""
    vit, stride = top["vit_config"], top["vae_config"]["downsample"] * top["latent_patch_size"]
    side, most = vit["image_size"], top["max_latent_size"] * stride  # the dummy image, the largest edited side
    scale = max(min(most / side, 1.0), min(256, most) / side)
    edited = min(max(stride, round(side * scale / stride) * stride), most)
    vit_tokens = (side // vit["patch_size"]) ** 2
    edit = (edited // stride) ** 2 + 2 + 1 + vit_tokens + 2
    return vit_tokens, edit, tiny_bagel.THINKER_TOKENS - edit + 1


@pytest.mark.parametrize("size", ["tiny", "full"])
def test_configs_fit_the_two_stage_thinker(size):
    """vLLM-Omni's two-stage thinker (vLLM's BagelForConditionalGeneration) builds the ViT only with visual_und, and
    its start-up profiling runs it on a dummy image to edit, then a dummy request whose positions outrun a RoPE table
    of max_position_embeddings rows (2048 indexed out of range); a dummy image's tokens are
    vit_max_num_patch_per_side^2 placeholders filled by (image_size / patch_size)^2 ViT outputs."""
    from jaxflow_bridge.families.bagel.full_size import FULL

    geo = tiny_bagel.TINY if size == "tiny" else FULL
    top, llm = tiny_bagel.top_config(geo), tiny_bagel.llm_config(geo)
    vit_tokens, edit, last = thinker_profile(top)
    assert top["visual_und"] is True
    assert vit_tokens == top["vit_max_num_patch_per_side"] ** 2 and edit < tiny_bagel.THINKER_TOKENS
    assert last < llm["max_position_embeddings"], (last, llm["max_position_embeddings"])
    assert (edit, last) == ((325, 32444) if size == "tiny" else (8626, 24143))


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
