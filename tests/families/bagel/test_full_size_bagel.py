"""BAGEL folders of any geometry (jaxflow_bridge/families/bagel/tiny.py's `Geometry`) and the full-size random
writer (jaxflow_bridge/families/bagel/full_size.py, scripts/make_random_bagel.py): the tiny folder byte for byte as
the writer before `Geometry` wrote it, BAGEL-7B-MoT's shapes listed without drawing (equal to the trainer's and the
bagel_torch engine's), and a shrunk full geometry written through the streamed path, loaded by the trainer and both
engines' fingerprints."""
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import weakref

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from jaxflow_bridge.families.bagel.keymap import IGNORED_PREFIXES, key_map
from jaxflow_bridge.families.bagel import full_size as fsb
from jaxflow_bridge.families.bagel import tiny as tiny_bagel
from jaxflow_bridge.families.bagel.vae import checkpoint_shapes
from jaxflow_bridge.families.bagel.full_size import FULL, build_bagel, draw_named, parameter_count, write_ema
from jaxflow_bridge.families.bagel.tiny import FILES, Geometry, tensor_shapes
from tests.helpers import ROOT
from tests import HANG_S

LLM = "language_model.model."
SMALL = Geometry(dict(FULL.llm, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2),
                 dict(FULL.vit, hidden_size=32, intermediate_size=64, num_attention_heads=2), FULL.top, FULL.vocab_size)
# sha256 of the tiny folder's configs (both dtypes): the writer's before `Geometry`, but for llm_config.json's
# max_position_embeddings 32768 and config.json's visual_und true (FORMAT_VERSION 4: the two-stage thinker)
CONFIG_SHA256 = {"llm_config.json": "d471fa727e2a548b", "config.json": "9126b244a8c486e5",
                 "vit_config.json": "dc2ad56efaca7ca1", "preprocessor_config.json": "e568470d1f57c531"}


def previous_tensors(seed: int, dtype: str) -> tuple[dict, dict]:
    """(ema, ae) tensors as the writer before `Geometry` drew them: one generator a component, fixed call order."""
    sd, vocab = {}, 384
    g = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731

    def linear(name, din, dout, bias=True):
        sd[f"{name}.weight"] = randn(dout, din) / math.sqrt(din)
        if bias:
            sd[f"{name}.bias"] = 0.1 * randn(dout)

    def norm(name, dim):
        sd[f"{name}.weight"] = 1.0 + 0.1 * randn(dim)

    def like(name, shape):
        if name.endswith(".bias"):
            sd[name] = 0.1 * randn(*shape)
        elif len(shape) == 1:
            sd[name] = 1.0 + 0.1 * randn(*shape)
        elif "embedding.weight" in name and len(shape) == 2 and "patch" not in name:
            sd[name] = randn(*shape)
        else:
            sd[name] = randn(*shape) / math.sqrt(math.prod(shape[1:]))

    sd[LLM + "embed_tokens.weight"] = randn(vocab, 64)
    for i in range(2):
        for e in ("", "_moe_gen"):
            p = f"{LLM}layers.{i}."
            for name, dout in (("q", 64), ("k", 32), ("v", 32)):
                linear(f"{p}self_attn.{name}_proj{e}", 64, dout)
            linear(f"{p}self_attn.o_proj{e}", 64, 64, bias=False)
            for name, dim in (("self_attn.q_norm", 16), ("self_attn.k_norm", 16), ("input_layernorm", 64),
                              ("post_attention_layernorm", 64)):
                norm(f"{p}{name}{e}", dim)
            for name, din, dout in (("gate", 64, 128), ("up", 64, 128), ("down", 128, 64)):
                linear(f"{p}mlp{e}.{name}_proj", din, dout, bias=False)
    norm(LLM + "norm", 64)
    norm(LLM + "norm_moe_gen", 64)
    linear("language_model.lm_head", 64, vocab, bias=False)
    g.manual_seed(seed + 1)
    for name, din, dout in (("time_embedder.mlp.0", 256, 64), ("time_embedder.mlp.2", 64, 64), ("vae2llm", 64, 64),
                            ("llm2vae", 64, 64)):
        linear(name, din, dout)
    sd["latent_pos_embed.pos_embed"] = tiny_bagel.sincos_2d(32, 64)
    g.manual_seed(seed + 2)
    for name, shape in tiny_bagel._vit_shapes(tiny_bagel.TINY_VIT).items():
        like(f"vit_model.{name}", shape)
    linear("connector.fc1", 32, 64)
    linear("connector.fc2", 64, 64)
    sd["vit_pos_embed.pos_embed"] = tiny_bagel.sincos_2d(8, 64)
    ema, sd = sd, {}
    g.manual_seed(seed + 3)
    for name, shape in checkpoint_shapes().items():
        like(name, shape)
    cast = lambda d: {k: v.to(tiny_bagel.DTYPES[dtype]).contiguous() for k, v in d.items()}  # noqa: E731
    return cast(ema), cast(sd)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_tiny_folder_is_the_previous_writers_byte_for_byte(dtype, tmp_path):
    folder = tiny_bagel.build_tiny_bagel(tmp_path / "tiny", seed=3, dtype=dtype)
    ema, ae = previous_tensors(3, dtype)
    for name, tensors in (("ema.safetensors", ema), ("ae.safetensors", ae)):
        save_file(tensors, tmp_path / name, metadata={"format": "pt"})
        assert (folder / name).read_bytes() == (tmp_path / name).read_bytes(), name
    for name, digest in CONFIG_SHA256.items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest()[:16] == digest, name
    assert tiny_bagel.FORMAT_VERSION == 4 and sorted(p.name for p in folder.iterdir()) == sorted(FILES)


@pytest.mark.slow
def test_the_cli_writes_the_tiny_folder(tmp_path):
    cli = [sys.executable, "scripts/make_random_bagel.py", "--size", "tiny", "--out", str(tmp_path / "t")]
    run = subprocess.run(cli, cwd=ROOT, check=True, capture_output=True, text=True, timeout=HANG_S)
    assert f"wrote {tmp_path / 't'}" in run.stdout
    cached = tiny_bagel.tiny_bagel_path(dtype="bfloat16")  # the CLI's default dtype
    for name in ("ema.safetensors", "ae.safetensors", "config.json"):
        assert (tmp_path / "t" / name).read_bytes() == (cached / name).read_bytes(), name
    again = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)  # refused before drawing
    assert again.returncode == 1 and again.stderr.strip().splitlines() == [
        f"error: --out {tmp_path / 't'} exists and is not an empty folder: name a new folder, or remove it first"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".t.")]  # no temporary folder left behind


# ---------------------------------------------------------------------------------------------- the full size


def test_full_size_shapes_are_bagel_7b_mots_without_drawing():
    shapes, d, kv, m, vocab = tensor_shapes(FULL), 3584, 512, 18944, 152064
    layer = {"self_attn.q_proj.weight": (d, d), "self_attn.q_proj.bias": (d,), "self_attn.k_proj.weight": (kv, d),
             "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, d), "self_attn.q_norm.weight": (128,),
             "mlp.gate_proj.weight": (m, d), "mlp.up_proj.weight": (m, d), "mlp.down_proj.weight": (d, m),
             "input_layernorm.weight": (d,)}
    for i in range(28):
        for name, shape in layer.items():
            gen = name.replace("mlp.", "mlp_moe_gen.") if name.startswith("mlp.") else name.replace(
                ".weight", "_moe_gen.weight").replace(".bias", "_moe_gen.bias")
            assert shapes[f"{LLM}layers.{i}.{name}"] == shapes[f"{LLM}layers.{i}.{gen}"] == shape, (i, name)
    assert not any(k.startswith(f"{LLM}layers.28.") for k in shapes)
    assert shapes[LLM + "embed_tokens.weight"] == shapes["language_model.lm_head.weight"] == (vocab, d)
    assert shapes["latent_pos_embed.pos_embed"] == (64 * 64, d) and shapes["vit_pos_embed.pos_embed"] == (70 * 70, d)
    vit = "vit_model.vision_model."
    assert shapes[vit + "embeddings.patch_embedding.weight"] == (1152, 3, 14, 14)
    assert shapes[vit + "embeddings.position_embedding.weight"] == (4900, 1152)
    assert {int(k.split(".")[4]) for k in shapes if k.startswith(vit + "encoder.layers.")} == set(range(26))
    assert tiny_bagel.vit_config(FULL)["num_hidden_layers"] == 27  # the released file's; 26 stored
    assert shapes["connector.fc1.weight"] == (d, 1152) and shapes["vae2llm.weight"] == (d, 64)
    # 233.0M a layer and expert (docs/bagel.md §1), 13.05B in both experts; 14.61B in the file
    per_layer = d * d + d + 2 * (kv * d + kv) + d * d + 2 * 128 + 2 * d + 3 * d * m
    assert abs(per_layer / 1e6 - 233.0) < 0.1 and round(2 * 28 * per_layer / 1e9, 2) == 13.05
    vit_layer = 4 * (1152 * 1152 + 1152) + 2 * 1152 * 4304 + 4304 + 1152 + 4 * 1152
    vit_total = 26 * vit_layer + 1152 * 3 * 14 * 14 + 1152 + 4900 * 1152 + 2 * 1152
    heads = 256 * d + d + d * d + d + 64 * d + d + d * 64 + 64 + 64 * 64 * d
    rest = 2 * vocab * d + 2 * d + 1152 * d + d + d * d + d + 4900 * d
    assert parameter_count(FULL) == 2 * 28 * per_layer + vit_total + heads + rest
    assert 14.5e9 < parameter_count(FULL) < 14.7e9


def test_full_size_shapes_are_the_trainers_and_the_bagel_torch_engines():
    """The tensors the trainer reads (all but IGNORED_PREFIXES) at the folder's geometry: BagelConfig's defaults
    (BAGEL-7B-MoT) but the markers, the abstract Flax model's leaves and BagelTorch's state dict on the meta device."""
    from flax import nnx

    from jaxflow.families.bagel.config import BagelConfig
    from jaxflow.families.bagel.model import BagelModel
    from jaxflow.nn.config import ModelOptions
    from jaxflow.nn.weights import state_leaf
    from jaxflow_bridge.families.bagel.model import BagelTorch

    ids = tiny_bagel.special_ids()
    markers = dict(vision_start_id=ids["<|vision_start|>"], vision_end_id=ids["<|vision_end|>"])
    cfg = BagelConfig.from_dicts(tiny_bagel.llm_config(FULL), tiny_bagel.top_config(FULL), **markers)
    assert cfg == BagelConfig(**markers) and markers == dict(vision_start_id=373, vision_end_id=374)
    used = {k: v for k, v in tensor_shapes(FULL).items() if not k.startswith(IGNORED_PREFIXES)}
    state = nnx.state(nnx.eval_shape(lambda: BagelModel(cfg, ModelOptions(), None, rngs=nnx.Rngs(0))), nnx.Param)
    flax = {}
    for e in key_map():
        shape = tuple(state_leaf(state, e.flax_path).shape)
        for k in e.diffusers_keys(cfg.num_hidden_layers):
            flax[k] = (shape[1:] if e.stacked else shape)[::-1 if e.transpose else 1]
    assert flax == used
    fields = {k: getattr(cfg, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                           "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "rope_theta",
                                           "vocab_size", "latent_patch_size", "z_channels", "max_latent_size")}
    with torch.device("meta"):
        engine = BagelTorch(**fields, **markers)
    assert {k: tuple(v.shape) for k, v in engine.state_dict().items()} == used


# ---------------------------------------------------------------------------------------------- the streamed path


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The full geometry shrunk (2 layers of width 64, a ViT of width 32 but 27 layers), in bf16, as the GPU's."""
    return build_bagel(tmp_path_factory.mktemp("bagel") / "small", SMALL, seed=0, dtype="bfloat16", device="cpu")


def test_the_shrunk_folder_keeps_the_full_configs_and_vocabulary(small):
    from transformers import AutoTokenizer

    assert sorted(p.name for p in small.iterdir()) == sorted(FILES)
    llm, top = (json.loads((small / n).read_text()) for n in ("llm_config.json", "config.json"))
    assert (llm["vocab_size"], llm["num_hidden_layers"], top["max_latent_size"]) == (152064, 2, 64)
    assert {k: top[k] for k in FULL.top} == FULL.top and top["vit_config"]["num_hidden_layers"] == 27
    tok = AutoTokenizer.from_pretrained(small)
    fields = tiny_bagel.bagel_torch_fields(small)
    assert max(tok.get_vocab().values()) < 384 < llm["vocab_size"] and fields["vision_end_id"] == 374
    assert json.loads((small / "preprocessor_config.json").read_text())["size"] == {"height": 980, "width": 980}


def test_each_tensor_is_its_own_draw_in_float32_cast_to_bf16(small, tmp_path):
    stored = load_file(small / "ema.safetensors")
    shapes = tensor_shapes(SMALL)
    assert {k: tuple(v.shape) for k, v in stored.items()} == shapes
    assert all(v.dtype == torch.bfloat16 for v in stored.values())
    for name in (LLM + "embed_tokens.weight", LLM + "layers.1.mlp_moe_gen.down_proj.weight",
                 LLM + "layers.0.self_attn.k_proj_moe_gen.bias", LLM + "norm_moe_gen.weight",
                 "vit_model.vision_model.encoder.layers.25.mlp.fc1.weight"):  # each drawn alone
        assert torch.equal(stored[name], draw_named(0, name, shapes[name]).to(torch.bfloat16)), name
    a, b = (stored[f"{LLM}layers.0.self_attn.q_proj{g}.weight"] for g in ("", "_moe_gen"))
    assert not torch.equal(a, b)  # seeded by name, not by shape
    assert torch.equal(stored["latent_pos_embed.pos_embed"], tiny_bagel.sincos_2d(64, 64).to(torch.bfloat16))
    write_ema(tmp_path / "f32.safetensors", SMALL, 0, "float32", "cpu")
    f32 = load_file(tmp_path / "f32.safetensors")
    assert [k for k in shapes if not torch.equal(f32[k].to(torch.bfloat16), stored[k])] == []
    assert f32[LLM + "embed_tokens.weight"].std().item() == pytest.approx(1.0, abs=0.01)  # a table ~ N(0, 1)


def test_the_writer_holds_one_drawn_tensor_at_a_time(tmp_path, monkeypatch):
    alive, drawn = [], []

    def tracked(*args, **kw):
        alive.append(sum(r() is not None for r in drawn))
        t = draw_named(*args, **kw)
        drawn.append(weakref.ref(t))
        return t

    monkeypatch.setattr(fsb, "draw_named", tracked)
    write_ema(tmp_path / "ema.safetensors", SMALL, 0, "bfloat16", "cpu")
    assert len(drawn) == len(tensor_shapes(SMALL)) - 2 and max(alive) == 0  # all but the sin-cos tables


def test_the_trainer_and_both_engines_load_the_shrunk_folder_with_one_fingerprint(small, tmp_path):
    from jaxflow import families
    from jaxflow.families.bagel.loading import arrays, load_bagel
    from jaxflow_bridge.families.bagel import keymap as bagel_keymap
    from jaxflow_bridge.families.bagel.engine import BagelTorchEngine
    from jaxflow_bridge.families.bagel.vllm_omni_kind import VllmOmniKind as Bagel

    model = load_bagel(small)
    stored = load_file(small / "ema.safetensors")
    for name, value in bagel_keymap.to_checkpoint(arrays(model), 2).items():
        np.testing.assert_array_equal(value, stored[name].float().numpy(), err_msg=name)
    engine = BagelTorchEngine({"engine": "bagel_torch", "model": str(small), "decode": "preview"})  # loads it all
    fingerprint = families.Bagel().fingerprint(model)
    assert fingerprint == engine.info()["fingerprint"] == Bagel(small).fingerprint()
    other = tmp_path / "seed1"
    shutil.copytree(small, other, ignore=shutil.ignore_patterns("*.safetensors"))
    write_ema(other / "ema.safetensors", SMALL, 1, "bfloat16", "cpu")
    assert Bagel(other).fingerprint() != fingerprint
