"""A tiny, deterministic, offline random BAGEL folder (docs/bagel.md §6), built from seeded configs, and the pieces
every BAGEL folder is written from, its geometry a ``Geometry`` (the full size: ``full_size_bagel.py``).

Files: ``llm_config.json`` (Qwen2 keys), ``config.json`` (BAGEL's top-level keys; ``visual_und`` true, so that
vLLM-Omni's two-stage thinker builds the ViT its start-up profiling runs), ``vit_config.json`` (a 1-layer SigLIP),
``ema.safetensors`` (every tensor BagelPipeline loads, under the names its ``load_weights`` maps: both LLM
experts, LM head, time embedder, vae2llm / llm2vae, the 2-D sin-cos ``latent_pos_embed`` and ``vit_pos_embed``, the
ViT as ``vit_model.vision_model.*`` and the connector), the tokenizer of ``tiny.py`` (byte-level BPE with the Qwen
special tokens, vocab 384), ``preprocessor_config.json`` and ``ae.safetensors`` (FLUX's autoencoder at the geometry
vLLM-Omni hard-codes, 84M parameters: ``families.bagel.vae.checkpoint_shapes``; random, so its images are not
meaningful).

Seeds: a ``torch.Generator`` seeded ``seed + k`` for component k (0 language model, 1 generation heads, 2 ViT and
connector, 3 autoencoder), drawing each component's tensors in ``components`` order, in float32, cast once to
``dtype``. By role (``draw``): weights ~ N(0, 1/fan_in), biases ~ N(0, 0.1^2), norm weights 1 + N(0, 0.1^2),
embedding tables ~ N(0, 1); the two position tables are BAGEL's fixed 2-D sin-cos. The global RNG is never touched.

CLI: ``python -m jaxflow_bridge.families.bagel.tiny --out DIR [--seed 0] [--dtype float32]``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from jaxflow_bridge.families.qwen_image import tiny
from jaxflow_bridge.rollout.model_cache import DTYPES, cached_folder, check_dtype, folder_cli
from jaxflow_bridge.families.bagel.vae import checkpoint_shapes

FORMAT_VERSION = 4  # 2: max_latent_size 32 (vLLM-Omni's 512 x 512 warm-up); 3: the FIM tokens (tiny.py);
# 4: visual_und true and max_position_embeddings 32768 (THINKER_TOKENS)
FILES = ("llm_config.json", "config.json", "vit_config.json", "ema.safetensors", "ae.safetensors", "tokenizer.json",
         "tokenizer_config.json", "vocab.json", "merges.txt", "preprocessor_config.json")
TIMESTEP_CHANNELS = 256
LLM = "language_model.model."
# the fixed 2-D sin-cos tables and the config.json key giving their side
SINCOS = {"latent_pos_embed.pos_embed": "max_latent_size", "vit_pos_embed.pos_embed": "vit_max_num_patch_per_side"}
# vLLM-Omni 0.20's thinker (deploy/bagel.yaml stage 0: max_num_batched_tokens) profiles an image to edit, then runs
# one dummy request this long whose text positions run up to about this (OmniBagelForConditionalGeneration.
# _adjust_positions_for_img2img): its RoPE table, max_position_embeddings rows, must cover them
THINKER_TOKENS = 32768

TINY_LLM = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1e6, hidden_act="silu",
                max_position_embeddings=THINKER_TOKENS, tie_word_embeddings=False)
TINY_VIT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=14,
                image_size=112, num_channels=3, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
                vision_use_head=False)
TINY_TOP = dict(latent_patch_size=2, max_latent_size=32, vae_config={"z_channels": 16, "downsample": 8},
                vit_max_num_patch_per_side=8, connector_act="gelu_pytorch_tanh", interpolate_pos=False,
                timestep_shift=1.0)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """A BAGEL folder's shape: llm_config.json's, vit_config.json's and config.json's own keys, and the rows of the
    token embedding and LM head (None: the tokenizer's 384; more rows leave ids past the tokenizer unused)."""

    llm: dict
    vit: dict
    top: dict
    vocab_size: int | None = None


TINY = Geometry(TINY_LLM, TINY_VIT, TINY_TOP)


def special_ids() -> dict[str, int]:
    """The tokenizer's special-token ids (tiny.py's vocabulary)."""
    vocab, _, _ = tiny.tokenizer_vocab()
    return {name: vocab[name] for name in tiny.QWEN_SPECIAL_TOKENS}


def llm_config(geo: Geometry = TINY) -> dict:
    _, _, tokens = tiny.tokenizer_vocab()
    ids = special_ids()
    return dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", **geo.llm, vocab_size=geo.vocab_size or tokens,
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], attention_dropout=0.0,
                initializer_range=0.02, use_cache=True, use_sliding_window=False, max_window_layers=geo.llm[
                    "num_hidden_layers"], qk_norm=True, layer_module="Qwen2MoTDecoderLayer", freeze_und=False)


def vit_config(geo: Geometry = TINY) -> dict:
    return dict(architectures=["SiglipVisionModel"], model_type="siglip_vision_model", **geo.vit)


def top_config(geo: Geometry = TINY) -> dict:
    """config.json: ``visual_und`` true (vLLM's BagelForConditionalGeneration, the two-stage thinker, builds no ViT
    otherwise, and its start-up profiling calls the ViT on a dummy image to edit)."""
    return dict(architectures=["BagelForConditionalGeneration"], model_type="bagel", visual_gen=True,
                visual_und=True, llm_config=llm_config(geo), vit_config=vit_config(geo), **geo.top)


def sincos_2d(size: int, hidden: int) -> torch.Tensor:
    """(size^2, hidden) float32: row r*size+c = [sin(c w), cos(c w), sin(r w), cos(r w)], w_k = 1e4^(-4k/hidden),
    evaluated in float64 (BAGEL's frozen ``PositionEmbedding`` table)."""
    w = 1.0 / 10000.0 ** (torch.arange(hidden // 4, dtype=torch.float64) / (hidden // 4))
    r, c = torch.div(torch.arange(size * size), size, rounding_mode="floor"), torch.arange(size * size) % size
    ac, ar = c[:, None].double() * w, r[:, None].double() * w
    return torch.cat([ac.sin(), ac.cos(), ar.sin(), ar.cos()], dim=1).float()


def draw(name: str, shape: tuple[int, ...], randn) -> torch.Tensor:
    """A float32 tensor of a state dict by its role, from ``randn(*shape)`` (standard normals): bias, 1-D weight (a
    norm), table (token or ViT position embedding) or weight."""
    if name.endswith(".bias"):
        return 0.1 * randn(*shape)
    if len(shape) == 1:
        return 1.0 + 0.1 * randn(*shape)
    if name.endswith("embed_tokens.weight") or ("embedding.weight" in name and len(shape) == 2 and "patch" not in name):
        return randn(*shape)
    return randn(*shape) / math.sqrt(math.prod(shape[1:]))


def stored_vit_layers(vit: dict) -> int:
    """ViT layers in ema.safetensors: BAGEL drops the last of SigLIP's 27 (vLLM-Omni's ``BagelPipeline`` builds 26
    when vit_config.json says 27, as BAGEL's own loaders build ``num_hidden_layers - 1``); others as configured."""
    return vit["num_hidden_layers"] - (vit["num_hidden_layers"] == 27)


def _vit_shapes(vit: dict) -> dict[str, tuple[int, ...]]:
    """``vision_model.*`` names and shapes of transformers' SiglipVisionModel at ``vit`` (``stored_vit_layers``)."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    with torch.device("meta"):
        model = SiglipVisionModel(SiglipVisionConfig(**dict(vit, num_hidden_layers=stored_vit_layers(vit))))
    # transformers 5 names them without the `vision_model.` that the checkpoint (transformers 4 layout) carries
    return {("" if k.startswith("vision_model.") else "vision_model.") + k: tuple(v.shape)
            for k, v in model.state_dict().items()}


def components(geo: Geometry = TINY) -> tuple[dict[str, tuple[int, ...]], ...]:
    """ema.safetensors' names and shapes per seed component (0 language model, 1 generation heads, 2 ViT and
    connector), in drawing order; nothing is drawn."""
    cfg, top = llm_config(geo), geo.top
    d, m, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = d // cfg["num_attention_heads"]
    nq, nkv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    latent = top["latent_patch_size"] ** 2 * top["vae_config"]["z_channels"]

    def linear(name, din, dout, bias=True):
        return {f"{name}.weight": (dout, din), **({f"{name}.bias": (dout,)} if bias else {})}

    lm = {LLM + "embed_tokens.weight": (vocab, d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"{LLM}layers.{i}."
        for g in ("", "_moe_gen"):
            for name, dout in (("q", nq), ("k", nkv), ("v", nkv)):
                lm |= linear(f"{p}self_attn.{name}_proj{g}", d, dout)
            lm |= linear(f"{p}self_attn.o_proj{g}", nq, d, bias=False)
            for name, dim in (("self_attn.q_norm", hd), ("self_attn.k_norm", hd), ("input_layernorm", d),
                              ("post_attention_layernorm", d)):
                lm[f"{p}{name}{g}.weight"] = (dim,)
            for name, din, dout in (("gate", d, m), ("up", d, m), ("down", m, d)):
                lm |= linear(f"{p}mlp{g}.{name}_proj", din, dout, bias=False)
    lm |= {LLM + "norm.weight": (d,), LLM + "norm_moe_gen.weight": (d,)}
    lm |= linear("language_model.lm_head", d, vocab, bias=False)
    gen = (linear("time_embedder.mlp.0", TIMESTEP_CHANNELS, d) | linear("time_embedder.mlp.2", d, d)
           | linear("vae2llm", latent, d) | linear("llm2vae", d, latent)
           | {"latent_pos_embed.pos_embed": (top["max_latent_size"] ** 2, d)})
    und = {f"vit_model.{k}": v for k, v in _vit_shapes(geo.vit).items()}
    und |= linear("connector.fc1", geo.vit["hidden_size"], d) | linear("connector.fc2", d, d)
    und["vit_pos_embed.pos_embed"] = (top["vit_max_num_patch_per_side"] ** 2, d)
    return lm, gen, und


def tensor_shapes(geo: Geometry = TINY) -> dict[str, tuple[int, ...]]:
    """Every tensor of ema.safetensors and its shape (``components`` in one dict)."""
    return {k: v for part in components(geo) for k, v in part.items()}


def sincos_table(name: str, geo: Geometry = TINY) -> torch.Tensor:
    """One of the ``SINCOS`` tables at ``geo``."""
    return sincos_2d(geo.top[SINCOS[name]], geo.llm["hidden_size"])


def weights(seed: int = 0, dtype: str = "float32", geo: Geometry = TINY) -> dict[str, torch.Tensor]:
    """Every tensor of ``ema.safetensors`` under BagelPipeline's names (see the module docstring for the seeds)."""
    check_dtype(dtype)
    sd = {}
    for k, part in enumerate(components(geo)):
        g = torch.Generator().manual_seed(seed + k)
        for name, shape in part.items():
            sd[name] = sincos_table(name, geo) if name in SINCOS else draw(
                name, shape, lambda *s: torch.randn(*s, generator=g))
    return {k: v.to(DTYPES[dtype]).contiguous() for k, v in sd.items()}


def ae_weights(seed: int = 0, dtype: str = "float32") -> dict[str, torch.Tensor]:
    """Every tensor of ``ae.safetensors`` (FLUX's names), drawn by role from a generator seeded ``seed + 3``."""
    check_dtype(dtype)
    g = torch.Generator().manual_seed(seed + 3)
    return {name: draw(name, shape, lambda *s: torch.randn(*s, generator=g)).to(DTYPES[dtype]).contiguous()
            for name, shape in checkpoint_shapes().items()}


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


def write_folder(out: Path, geo: Geometry, seed: int, dtype: str, write_ema: Callable[[Path], None]) -> None:
    """Every file of a BAGEL folder at ``geo`` into the folder ``out``; ``write_ema(path)`` writes ema.safetensors."""
    out.chmod(0o755)  # a temporary folder from mkdtemp is 0700
    dump = lambda name, obj: (out / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")  # noqa: E731
    dump("llm_config.json", llm_config(geo))
    dump("config.json", top_config(geo))
    dump("vit_config.json", vit_config(geo))
    side = geo.vit["image_size"]
    dump("preprocessor_config.json", dict(image_processor_type="SiglipImageProcessor", do_resize=True,
                                          size={"height": side, "width": side}, do_rescale=True,
                                          rescale_factor=1 / 255, do_normalize=True, image_mean=[0.5, 0.5, 0.5],
                                          image_std=[0.5, 0.5, 0.5], resample=3))
    write_ema(out / "ema.safetensors")
    save_file(ae_weights(seed, dtype), out / "ae.safetensors", metadata={"format": "pt"})
    tiny.build_tokenizer().save_pretrained(out)
    tiny.save_slow_tokenizer_files(out)


def _write(out: Path, seed: int, dtype: str) -> None:
    write_folder(out, TINY, seed, dtype,
                 lambda path: save_file(weights(seed, dtype), path, metadata={"format": "pt"}))


def build_atomically(out_dir, write: Callable[[Path], None]) -> Path:
    """``write(folder)`` into a temporary sibling of ``out_dir`` (which must not exist or be empty), then a rename.
    A file or a folder with something in it is refused before anything is written (FileExistsError)."""
    out = Path(out_dir)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder: name a new folder, or remove it first")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write(tmp)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def build_tiny_bagel(out_dir, seed: int = 0, dtype: str = "float32") -> Path:
    """Write the tiny BAGEL folder to ``out_dir`` atomically (``build_atomically``). The same (seed, dtype) gives
    identical tensors."""
    check_dtype(dtype)
    return build_atomically(out_dir, lambda tmp: _write(tmp, seed, dtype))


def tiny_bagel_path(seed: int = 0, dtype: str = "float32") -> Path:
    """The cached tiny BAGEL folder under ``model_cache.cache_root()``, built on first use and reused afterwards."""
    check_dtype(dtype)
    return cached_folder(f"bagel_tiny-v{FORMAT_VERSION}-seed{seed}-{dtype}", "ema.safetensors",
                              lambda tmp: _write(tmp, seed, dtype))


def main(argv=None) -> None:
    folder_cli(__doc__, build_tiny_bagel, argv)


if __name__ == "__main__":
    main()
