"""The mini model's diffusers folder and what the JAX pretraining reads from it.

The folder is the tiny offline pipeline (`jaxflow_bridge/families/qwen_image/tiny.py`: tokenizer, text encoder,
scheduler)
with the trained VAE and a fresh transformer of a `SIZES` config in place of its own; the pretraining then overwrites
`transformer/` with its weights (`jaxflow/families/qwen_image/loading.py: save_transformer`).
Text embeddings come from the folder through `RolloutPipeline.encode`, the rollout's own text path.
`bf16_copy` writes the folder in bf16 for the vLLM-Omni arms (`configs/mini_ocr.py`'s omni and omni_fp8): vLLM-Omni 0.20
serves bf16 folders only (`jaxflow_bridge/engines/vllm_omni/rules.py`).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxflow_bridge.families.qwen_image.tiny import TINY_TRANSFORMER_CONFIG, build_pipeline, save_folder

# "mini": the proof's model (8 blocks of width 384, about 45M params); "toy": CPU smoke tests.
SIZES = {
    "mini": dict(TINY_TRANSFORMER_CONFIG, num_layers=8, attention_head_dim=64, num_attention_heads=6,
                 axes_dims_rope=(8, 28, 28)),
    "toy": dict(TINY_TRANSFORMER_CONFIG, num_layers=1, attention_head_dim=32, num_attention_heads=2),
}


def build_folder(out: str | Path, vae, size: str = "mini", seed: int = 0) -> Path:
    """Write the pipeline folder with `vae` and a seeded random transformer of `SIZES[size]`."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    return save_folder(build_pipeline(seed, transformer_config=SIZES[size], vae=vae), out)


def bf16_copy(folder: str | Path, out: str | Path) -> Path:
    """Write the pipeline folder `folder` to `out` with every component's weights in bf16."""
    import torch

    from jaxflow_bridge.families.qwen_image.diffusers_pipeline import RolloutPipeline

    pipe = RolloutPipeline.diffusers_pipeline(folder, dtype=torch.bfloat16, local_files_only=True)
    return save_folder(pipe, out)


def encode_text(pipeline, prompts: list[str], negative: str = " ") -> dict[str, np.ndarray]:
    """float32 text embeddings, all right-padded to one length L: embeds (P, L, D), mask (P, L), and the negative
    prompt's neg_embeds (L, D), neg_mask (L,)."""
    out = []
    for i in range(0, len(prompts) + 1, 512):
        out += pipeline.encode((list(prompts) + [negative])[i:i + 512])
    length = max(len(e) for e in out)
    embeds = np.zeros((len(out), length, out[0].shape[-1]), np.float32)
    mask = np.zeros((len(out), length), bool)
    for i, e in enumerate(out):
        embeds[i, :len(e)] = e.float().cpu().numpy()
        mask[i, :len(e)] = True
    return dict(embeds=embeds[:-1], mask=mask[:-1], neg_embeds=embeds[-1], neg_mask=mask[-1])
