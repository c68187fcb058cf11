"""A tiny, deterministic, offline random BAGEL folder (docs/bagel.md §6), built from seeded configs.

Files: ``llm_config.json`` (Qwen2 keys), ``config.json`` (BAGEL's top-level keys), ``vit_config.json`` (a 1-layer
SigLIP), ``ema.safetensors`` (every tensor BagelPipeline loads, under the names its ``load_weights`` maps: both LLM
experts, LM head, time embedder, vae2llm / llm2vae, the 2-D sin-cos ``latent_pos_embed`` and ``vit_pos_embed``, the
ViT as ``vit_model.vision_model.*`` and the connector), the tokenizer of ``tiny.py`` (byte-level BPE with the Qwen
special tokens, vocab 384), ``preprocessor_config.json`` and ``ae.safetensors`` (FLUX's autoencoder at the geometry
vLLM-Omni hard-codes, 84M parameters: ``bagel_vae.checkpoint_shapes``; random, so its images are not meaningful).

Seeds: a ``torch.Generator`` seeded ``seed + k`` for component k (0 language model, 1 generation heads, 2 ViT and
connector, 3 autoencoder); tensors are drawn in float32 and cast once to ``dtype``. Linears ~ N(0, 1/fan_in), biases
~ N(0, 0.1^2), norm weights 1 + N(0, 0.1^2), embedding tables ~ N(0, 1). The global RNG is never touched.

CLI: ``python -m jaxflow_bridge.rollout.tiny_bagel --out DIR [--seed 0] [--dtype float32]``.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from jaxflow_bridge.rollout import tiny
from jaxflow_bridge.rollout.bagel_vae import checkpoint_shapes

FORMAT_VERSION = 2  # 2: max_latent_size 32 (vLLM-Omni's 512 x 512 warm-up)
DTYPES = tiny.DTYPES
FILES = ("llm_config.json", "config.json", "vit_config.json", "ema.safetensors", "ae.safetensors", "tokenizer.json",
         "tokenizer_config.json", "vocab.json", "merges.txt", "preprocessor_config.json")
TIMESTEP_CHANNELS = 256
LLM = "language_model.model."

TINY_LLM = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1e6, hidden_act="silu",
                max_position_embeddings=2048, tie_word_embeddings=False)
TINY_VIT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=14,
                image_size=112, num_channels=3, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
                vision_use_head=False)
TINY_TOP = dict(latent_patch_size=2, max_latent_size=32, vae_config={"z_channels": 16, "downsample": 8},
                vit_max_num_patch_per_side=8, connector_act="gelu_pytorch_tanh", interpolate_pos=False,
                timestep_shift=1.0)


def special_ids() -> dict[str, int]:
    """The tokenizer's special-token ids (tiny.py's vocabulary)."""
    vocab, _, _ = tiny.tokenizer_vocab()
    return {name: vocab[name] for name in tiny.QWEN_SPECIAL_TOKENS}


def llm_config() -> dict:
    _, _, vocab_size = tiny.tokenizer_vocab()
    ids = special_ids()
    return dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", **TINY_LLM, vocab_size=vocab_size,
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], attention_dropout=0.0,
                initializer_range=0.02, use_cache=True, use_sliding_window=False, max_window_layers=TINY_LLM[
                    "num_hidden_layers"], qk_norm=True, layer_module="Qwen2MoTDecoderLayer", freeze_und=False)


def vit_config() -> dict:
    return dict(architectures=["SiglipVisionModel"], model_type="siglip_vision_model", **TINY_VIT)


def top_config() -> dict:
    return dict(architectures=["BagelForConditionalGeneration"], model_type="bagel", visual_gen=True,
                visual_und=False, llm_config=llm_config(), vit_config=vit_config(), **TINY_TOP)


def sincos_2d(size: int, hidden: int) -> torch.Tensor:
    """(size^2, hidden) float32: row r*size+c = [sin(c w), cos(c w), sin(r w), cos(r w)], w_k = 1e4^(-4k/hidden),
    evaluated in float64 (BAGEL's frozen ``PositionEmbedding`` table)."""
    w = 1.0 / 10000.0 ** (torch.arange(hidden // 4, dtype=torch.float64) / (hidden // 4))
    r, c = torch.div(torch.arange(size * size), size, rounding_mode="floor"), torch.arange(size * size) % size
    ac, ar = c[:, None].double() * w, r[:, None].double() * w
    return torch.cat([ac.sin(), ac.cos(), ar.sin(), ar.cos()], dim=1).float()


class _Drawer:
    """Seeded float32 tensors into one state dict, in call order."""

    def __init__(self, sd: dict, seed: int):
        self.sd, self.g = sd, torch.Generator().manual_seed(seed)

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.g)

    def linear(self, name, din, dout, bias=True):
        self.sd[f"{name}.weight"] = self.randn(dout, din) / math.sqrt(din)
        if bias:
            self.sd[f"{name}.bias"] = 0.1 * self.randn(dout)

    def norm(self, name, dim):
        self.sd[f"{name}.weight"] = 1.0 + 0.1 * self.randn(dim)

    def like(self, name, shape):
        """A tensor of a module's state dict by its role: bias, 1-D weight (a norm), table or weight."""
        if name.endswith(".bias"):
            self.sd[name] = 0.1 * self.randn(*shape)
        elif len(shape) == 1:
            self.sd[name] = 1.0 + 0.1 * self.randn(*shape)
        elif "embedding.weight" in name and len(shape) == 2 and "patch" not in name:
            self.sd[name] = self.randn(*shape)
        else:
            self.sd[name] = self.randn(*shape) / math.sqrt(math.prod(shape[1:]))


def _vit_shapes() -> dict[str, tuple[int, ...]]:
    """``vision_model.*`` names and shapes of transformers' SiglipVisionModel at TINY_VIT."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    with torch.device("meta"):
        model = SiglipVisionModel(SiglipVisionConfig(**TINY_VIT))
    # transformers 5 names them without the `vision_model.` that the checkpoint (transformers 4 layout) carries
    return {("" if k.startswith("vision_model.") else "vision_model.") + k: tuple(v.shape)
            for k, v in model.state_dict().items()}


def weights(seed: int = 0, dtype: str = "float32") -> dict[str, torch.Tensor]:
    """Every tensor of ``ema.safetensors`` under BagelPipeline's names (see the module docstring for the seeds)."""
    tiny.check_dtype(dtype)
    cfg, vit, top = llm_config(), TINY_VIT, TINY_TOP
    d, m, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = d // cfg["num_attention_heads"]
    nq, nkv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    latent = top["latent_patch_size"] ** 2 * top["vae_config"]["z_channels"]
    sd: dict[str, torch.Tensor] = {}

    lm = _Drawer(sd, seed)
    sd[LLM + "embed_tokens.weight"] = lm.randn(vocab, d)
    for i in range(cfg["num_hidden_layers"]):
        p = f"{LLM}layers.{i}."
        for g in ("", "_moe_gen"):
            for name, dout in (("q", nq), ("k", nkv), ("v", nkv)):
                lm.linear(f"{p}self_attn.{name}_proj{g}", d, dout)
            lm.linear(f"{p}self_attn.o_proj{g}", nq, d, bias=False)
            lm.norm(f"{p}self_attn.q_norm{g}", hd)
            lm.norm(f"{p}self_attn.k_norm{g}", hd)
            lm.norm(f"{p}input_layernorm{g}", d)
            lm.norm(f"{p}post_attention_layernorm{g}", d)
            for name, din, dout in (("gate", d, m), ("up", d, m), ("down", m, d)):
                lm.linear(f"{p}mlp{g}.{name}_proj", din, dout, bias=False)
    lm.norm(LLM + "norm", d)
    lm.norm(LLM + "norm_moe_gen", d)
    lm.linear("language_model.lm_head", d, vocab, bias=False)

    gen = _Drawer(sd, seed + 1)
    gen.linear("time_embedder.mlp.0", TIMESTEP_CHANNELS, d)
    gen.linear("time_embedder.mlp.2", d, d)
    gen.linear("vae2llm", latent, d)
    gen.linear("llm2vae", d, latent)
    sd["latent_pos_embed.pos_embed"] = sincos_2d(top["max_latent_size"], d)

    und = _Drawer(sd, seed + 2)
    for name, shape in _vit_shapes().items():
        und.like(f"vit_model.{name}", shape)
    und.linear("connector.fc1", vit["hidden_size"], d)
    und.linear("connector.fc2", d, d)
    sd["vit_pos_embed.pos_embed"] = sincos_2d(top["vit_max_num_patch_per_side"], d)
    return {k: v.to(DTYPES[dtype]).contiguous() for k, v in sd.items()}


def ae_weights(seed: int = 0, dtype: str = "float32") -> dict[str, torch.Tensor]:
    """Every tensor of ``ae.safetensors`` (FLUX's names), drawn by role from a generator seeded ``seed + 3``."""
    tiny.check_dtype(dtype)
    sd: dict[str, torch.Tensor] = {}
    ae = _Drawer(sd, seed + 3)
    for name, shape in checkpoint_shapes().items():
        ae.like(name, shape)
    return {k: v.to(DTYPES[dtype]).contiguous() for k, v in sd.items()}


def bagel_torch_fields(folder) -> dict:
    """``BagelTorch`` keyword arguments read from a BAGEL folder's llm_config.json, config.json and tokenizer.json."""
    folder = Path(folder)
    llm = json.loads((folder / "llm_config.json").read_text())
    top = json.loads((folder / "config.json").read_text())
    added = {t["content"]: t["id"] for t in json.loads((folder / "tokenizer.json").read_text())["added_tokens"]}
    fields = {k: llm[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                  "num_key_value_heads", "rms_norm_eps", "rope_theta", "vocab_size")}
    return dict(fields, latent_patch_size=top["latent_patch_size"], z_channels=top["vae_config"]["z_channels"],
                max_latent_size=top["max_latent_size"], vision_start_id=added["<|vision_start|>"],
                vision_end_id=added["<|vision_end|>"])


def _write(out: Path, seed: int, dtype: str) -> None:
    out.chmod(0o755)  # a temporary folder from mkdtemp is 0700
    dump = lambda name, obj: (out / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")  # noqa: E731
    dump("llm_config.json", llm_config())
    dump("config.json", top_config())
    dump("vit_config.json", vit_config())
    dump("preprocessor_config.json", dict(image_processor_type="SiglipImageProcessor", do_resize=True,
                                          size={"height": TINY_VIT["image_size"], "width": TINY_VIT["image_size"]},
                                          do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
                                          image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], resample=3))
    save_file(weights(seed, dtype), out / "ema.safetensors", metadata={"format": "pt"})
    save_file(ae_weights(seed, dtype), out / "ae.safetensors", metadata={"format": "pt"})
    tiny.build_tokenizer().save_pretrained(out)
    tiny.save_slow_tokenizer_files(out)


def build_tiny_bagel(out_dir, seed: int = 0, dtype: str = "float32") -> Path:
    """Write the tiny BAGEL folder to ``out_dir`` (which must not exist or be empty), atomically: a temporary
    sibling folder, then a rename. The same (seed, dtype) gives identical tensors."""
    tiny.check_dtype(dtype)
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write(tmp, seed, dtype)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def tiny_bagel_path(seed: int = 0, dtype: str = "float32") -> Path:
    """The cached tiny BAGEL folder under ``tiny.cache_root()``, built on first use and reused afterwards."""
    tiny.check_dtype(dtype)
    return tiny.cached_folder(f"bagel_tiny-v{FORMAT_VERSION}-seed{seed}-{dtype}", "ema.safetensors",
                              lambda tmp: _write(tmp, seed, dtype))


def main(argv=None) -> None:
    tiny.folder_cli(__doc__, build_tiny_bagel, argv)


if __name__ == "__main__":
    main()
