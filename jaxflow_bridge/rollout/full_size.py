"""A Qwen-Image pipeline at the real size with random weights, for benchmarks and `model.init=random` runs (nothing
downloaded): the real transformer (20.4B) and VAE configs, a text encoder of the real width (3584) but 2 layers, the
byte-level tokenizer and scheduler of `tiny.py`. `scripts/make_random_pipeline.py` writes it as a folder."""
from __future__ import annotations

import torch

from jaxflow_bridge.rollout.tiny import TINY_VAE_CONFIG, assemble, text_encoder

# Qwen/Qwen-Image's vae/config.json (the latent statistics are the tiny VAE's, which copies them)
VAE_CONFIG = dict(TINY_VAE_CONFIG, base_dim=96, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                  temperal_downsample=[False, True, True])
# Qwen2.5-VL-7B's text width, heads and rope; 2 of its 28 layers
TEXT_CONFIG = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=2, num_attention_heads=28,
                   num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=1e6,
                   rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"})
VISION_CONFIG = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=3584)


def full_size_pipeline(device, transformer_device=None):
    """The pipeline in bf16 on `device` (seed 0); `transformer_device="meta"` builds the transformer's config only."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            with torch.device(transformer_device or device):
                transformer = QwenImageTransformer2DModel()
            vae = AutoencoderKLQwenImage(**VAE_CONFIG)
            encoder = text_encoder(TEXT_CONFIG, VISION_CONFIG)
    finally:
        torch.set_default_dtype(torch.float32)
    return assemble(transformer, vae, encoder)
