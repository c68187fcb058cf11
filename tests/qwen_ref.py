"""Seeded tiny diffusers Qwen-Image transformers (with or without a random PEFT adapter) and inputs for parity tests
(torch side of the comparison)."""
from __future__ import annotations

import numpy as np
import torch
from diffusers import QwenImageTransformer2DModel
from peft import LoraConfig, get_peft_model_state_dict

TINY = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=32,
            num_attention_heads=2, joint_attention_dim=64, guidance_embeds=False, axes_dims_rope=(8, 12, 12))
# A second shape: more heads, smaller head dim, three layers, odd text width.
OTHER = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=3, attention_head_dim=16,
             num_attention_heads=3, joint_attention_dim=24, guidance_embeds=False, axes_dims_rope=(4, 6, 6))


def torch_model(cfg: dict, seed: int = 0) -> QwenImageTransformer2DModel:
    """diffusers model with every parameter (norm weights and biases too) randomised from `seed`."""
    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(**cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def state_dict_numpy(model) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() if v.dtype != torch.bfloat16 else v for k, v in model.state_dict().items()}


def torch_with_adapter(cfg: dict, spec, seed: int = 0) -> tuple[QwenImageTransformer2DModel, dict, dict]:
    """(`torch_model(cfg, seed)` with a PEFT adapter of `spec`'s rank, alpha and targets, random 0.2 * N(0, 1)
    factors, its base state dict and the adapter's PEFT state dict), both as numpy."""
    tm = torch_model(cfg, seed)
    base = state_dict_numpy(tm)
    tm.add_adapter(LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets),
                              init_lora_weights="gaussian"))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in tm.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return tm, base, {k: v.numpy() for k, v in get_peft_model_state_dict(tm).items()}


def inputs(cfg: dict, batch=2, grid=(5, 9), txt_lens=(7, 4), sigmas=(1.0, 0.37), seed=0):
    """Random latents/text with right-padded masks; returns numpy arrays."""
    rng = np.random.default_rng(seed)
    h, w = grid
    L = max(txt_lens)
    x = rng.standard_normal((batch, h * w, cfg["in_channels"])).astype(np.float32)
    txt = rng.standard_normal((batch, L, cfg["joint_attention_dim"])).astype(np.float32)
    mask = np.zeros((batch, L), bool)
    for b, n in enumerate(txt_lens):
        mask[b, :n] = True
        txt[b, n:] = 0.0
    return x, np.asarray(sigmas, np.float32), txt, mask


def torch_forward(model, x, sigma, txt, mask, grid, dtype=torch.float32):
    h, w = grid
    with torch.no_grad():
        out = model(hidden_states=torch.from_numpy(x).to(dtype), timestep=torch.from_numpy(sigma).to(dtype),
                    encoder_hidden_states=torch.from_numpy(txt).to(dtype),
                    encoder_hidden_states_mask=None if mask is None else torch.from_numpy(mask),
                    img_shapes=[[(1, h, w)]] * x.shape[0], return_dict=False)[0]
    return out.float().numpy()
