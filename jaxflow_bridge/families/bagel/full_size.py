"""A BAGEL folder with random weights at BAGEL-7B-MoT's released geometry (``FULL``: 14.6B parameters, ema.safetensors
29.2 GB in bf16), for full-size runs on vLLM-Omni, whose BAGEL pipeline has no random-weight path: it and the
trainer (``load_bagel``) load the folder as a checkpoint. ``scripts/make_random_bagel.py`` writes it.

Geometry, and where each value was read (docs/bagel.md §1; vLLM-Omni 0.20's
``vllm_omni/diffusion/models/bagel/pipeline_bagel.py`` and ``bagel_transformer.py``; BAGEL's own loaders, as
quoted by public code using them: ``BagelConfig(vit_max_num_patch_per_side=70, connector_act='gelu_pytorch_tanh',
latent_patch_size=2, max_latent_size=64)``, ``vit_config.num_hidden_layers - 1``, ``ImageTransform(980, 224, 14)``):

- llm_config.json, Qwen2.5-7B: hidden 3584, intermediate 18944, 28 layers, 28 heads, 4 KV heads, rope_theta 1e6,
  RMS eps 1e-6, silu, untied, vocab 152064 (docs/bagel.md §1, ``jaxflow/families/bagel/config.BagelConfig``'s
  defaults, ``full_size.py``'s Qwen2.5-VL-7B text tower); max_position_embeddings 32768 (Qwen2.5-7B-Instruct's and
  vLLM-Omni's ``Qwen2MoTConfig`` default; the two-stage thinker's RoPE rows, ``tiny_bagel.THINKER_TOKENS``).
- vit_config.json, SigLIP so400m-patch14: hidden 1152, intermediate 4304, 27 layers, 16 heads, patch 14,
  gelu_pytorch_tanh, eps 1e-6 (the so400m config); image 980 = 70 patches of 14 a side (BAGEL's ViT transform and
  ``vit_max_num_patch_per_side``); no head (vLLM-Omni forces ``vision_use_head=False``). ema.safetensors holds 26
  ViT layers: vLLM-Omni builds 26 when the file says 27, as BAGEL's loaders do (``stored_vit_layers``).
- config.json: visual_und true (``tiny_bagel.top_config``: the two-stage thinker's ViT), latent_patch_size 2,
  max_latent_size 64 (BAGEL's loaders; vLLM-Omni sizes its table from the stored one), vae z_channels 16 /
  downsample 8 (FLUX's autoencoder, vLLM-Omni's ``default_ae_params``), vit_max_num_patch_per_side 70,
  connector_act gelu_pytorch_tanh, interpolate_pos False, timestep_shift 1.0 (BAGEL's loaders; vLLM-Omni's
  ``BagelConfig`` defaults).

Tokenizer: ``tiny.py``'s 384 ids (the markers ``<|vision_start|>`` / ``<|vision_end|>`` are 373 / 374, read from
tokenizer.json by the trainer and both engines) under llm_config's vocab_size 152064: the embedding and LM head keep
the released 152064 rows (vLLM-Omni takes max(vocab_size, tokenizer length)); ids 384 and up are never fed.

Weights: each tensor drawn alone in float32 on ``device`` from a ``torch.Generator`` seeded by its name
(``name_seed``), by ``tiny_bagel.draw``'s roles, then cast to ``dtype``; the sin-cos tables computed. So a tensor
does not depend on which others are drawn or in what order, but does on the device (CPU and CUDA streams differ).
ema.safetensors is one file, as released, not shards: vLLM-Omni loads every root ``*.safetensors``, but the trainer
(``load_bagel``), the bagel_torch engine and the vllm_omni kind's fingerprint read ``ema.safetensors`` alone. It is
written streamed (``safetensors_io.save_streamed``): one tensor in memory at a time, the largest the 152064 x 3584
embedding (2.2 GB in float32, then 1.1 GB in bf16 on the host).
"""
from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np
import torch

from jaxflow_bridge.contract.safetensors_io import save_streamed
from jaxflow_bridge.rollout.model_cache import check_dtype
from jaxflow_bridge.rollout.tensors import torch_to_numpy
from jaxflow_bridge.families.bagel.tiny import (DTYPES, SINCOS, Geometry, build_atomically, draw, sincos_table,
                                               tensor_shapes, write_folder)

FULL_LLM = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=1e6, hidden_act="silu",
                max_position_embeddings=32768, tie_word_embeddings=False)
FULL_VIT = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16, patch_size=14,
                image_size=980, num_channels=3, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
                vision_use_head=False)
FULL_TOP = dict(latent_patch_size=2, max_latent_size=64, vae_config={"z_channels": 16, "downsample": 8},
                vit_max_num_patch_per_side=70, connector_act="gelu_pytorch_tanh", interpolate_pos=False,
                timestep_shift=1.0)
FULL = Geometry(FULL_LLM, FULL_VIT, FULL_TOP, vocab_size=152064)


def name_seed(seed: int, name: str) -> int:
    """A tensor's generator seed: the first 8 bytes (little-endian) of sha256(f"{seed}:{name}")."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def draw_named(seed: int, name: str, shape: tuple[int, ...], device="cpu") -> torch.Tensor:
    """One weight, float32 on ``device``, from its own generator (``name_seed``)."""
    g = torch.Generator(device=device).manual_seed(name_seed(seed, name))
    return draw(name, shape, lambda *s: torch.randn(*s, generator=g, device=device))


def parameter_count(geo: Geometry = FULL) -> int:
    """Elements of ema.safetensors at ``geo`` (nothing drawn)."""
    return sum(math.prod(shape) for shape in tensor_shapes(geo).values())


def write_ema(path: Path, geo: Geometry, seed: int, dtype: str, device) -> None:
    """ema.safetensors at ``geo``: each tensor drawn (``draw_named``), cast, copied to the host and written before
    the next."""
    shapes = tensor_shapes(geo)
    stored = torch_to_numpy(torch.empty(0, dtype=DTYPES[dtype])).dtype  # numpy's name for the file's dtype

    def produce(name: str) -> np.ndarray:
        t = sincos_table(name, geo) if name in SINCOS else draw_named(seed, name, shapes[name], device)
        return torch_to_numpy(t.to(DTYPES[dtype]))

    save_streamed({k: (stored, v) for k, v in shapes.items()}, produce, path, {"format": "pt"})


def build_bagel(out_dir, geo: Geometry = FULL, seed: int = 0, dtype: str = "bfloat16", device=None) -> Path:
    """Write a random BAGEL folder at ``geo`` to ``out_dir`` (absent or empty; via a temporary sibling and a rename),
    drawing on ``device`` (default: cuda when available, else cpu); every file of ``tiny_bagel.FILES``."""
    check_dtype(dtype)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return build_atomically(out_dir, lambda tmp: write_folder(
        tmp, geo, seed, dtype, lambda path: write_ema(path, geo, seed, dtype, device)))
