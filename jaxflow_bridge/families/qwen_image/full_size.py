"""A Qwen-Image pipeline at the real size with random weights, for benchmarks and `model.init=random` runs (nothing
downloaded): the real transformer (20.4B) and VAE configs, the byte-level tokenizer and scheduler of `tiny.py`, and
a text encoder of Qwen2.5-VL-7B's size (28 layers, its vocabulary's 152,064 embedding rows and untied output head,
its vision tower: 8.3B parameters, as much memory as the released one) or, `text_encoder="short"`, of its width but
2 layers and a tiny vision tower (0.5B). `scripts/make_random_pipeline.py` writes it as a folder."""
from __future__ import annotations

import torch

from jaxflow_bridge.families.qwen_image.tiny import PROMPT_TEMPLATE, TINY_VAE_CONFIG, assemble
from jaxflow_bridge.families.qwen_image.tiny import text_encoder as make_text_encoder

# Qwen/Qwen-Image's vae/config.json (the latent statistics are the tiny VAE's, which copies them)
VAE_CONFIG = dict(TINY_VAE_CONFIG, base_dim=96, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                  temperal_downsample=[False, True, True])
# Qwen2.5-VL-7B's text tower (Qwen/Qwen2.5-VL-7B-Instruct config.json) and vision tower
TEXT_CONFIG = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                   num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=1e6,
                   rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"})
VISION_CONFIG = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                     fullatt_block_indexes=[7, 15, 23, 31], window_size=112, hidden_act="silu")
VOCAB_SIZE = 152064
# the short encoder: 2 of the 28 layers, the tokenizer's own vocabulary, a 1-layer vision tower of width 16
SHORT_TEXT_CONFIG = dict(TEXT_CONFIG, num_hidden_layers=2)
SHORT_VISION_CONFIG = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=3584)
TEXT_ENCODERS = ("full", "short")


def full_size_pipeline(device, transformer_device=None, text_encoder: str = "full"):
    """The pipeline in bf16 on `device` (seed 0); `transformer_device="meta"` builds the transformer's config only;
    `text_encoder`: "full" (Qwen2.5-VL-7B's size) or "short" (2 layers)."""
    return assemble(*full_size_modules(device, transformer_device, text_encoder))


def full_size_modules(device, transformer_device=None, text_encoder: str = "full",
                      templates: tuple[str, ...] = (PROMPT_TEMPLATE,)):
    """`full_size_pipeline`'s (transformer, vae, text encoder); the encoder's token ids are those of
    `build_tokenizer(templates)` (a family whose prompt templates add words: Qwen-Image-Edit)."""
    if text_encoder not in TEXT_ENCODERS:
        raise ValueError(f"text_encoder must be one of {TEXT_ENCODERS}, got {text_encoder!r}")
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            with torch.device(transformer_device or device):
                transformer = QwenImageTransformer2DModel()
            vae = AutoencoderKLQwenImage(**VAE_CONFIG)
            encoder = (make_text_encoder(TEXT_CONFIG, VISION_CONFIG, vocab_size=VOCAB_SIZE, templates=templates)
                       if text_encoder == "full" else
                       make_text_encoder(SHORT_TEXT_CONFIG, SHORT_VISION_CONFIG, templates=templates))
    finally:
        torch.set_default_dtype(torch.float32)
    return transformer, vae, encoder
