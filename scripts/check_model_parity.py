"""Flax vs diffusers Qwen-Image transformer parity on a diffusers folder (default: the tiny offline pipeline).

    python scripts/check_model_parity.py [--model DIR] [--tol 1e-5]

Prints max|d|/max|ref| per case for fp32 and bf16 (bf16 against the fp32 diffusers reference) and exits 1
if an fp32 case exceeds --tol or a bf16 case exceeds 2e-2.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import torch
from diffusers import QwenImageTransformer2DModel

from jaxflow.nn.config import ModelOptions
from jaxflow.families.qwen_image.loading import load_transformer

CASES = [  # (name, grid, text lengths, sigmas)
    ("square 4x4, full text", (4, 4), (8, 8), (1.0, 0.5)),
    ("odd 5x9, padded text", (5, 9), (11, 5), (0.93, 0.2)),
    ("tall 9x5, low sigma", (9, 5), (3, 12), (0.05, 0.02)),
]


def inputs(cfg, grid, lens, sigmas, seed):
    rng = np.random.default_rng(seed)
    h, w = grid
    x = rng.standard_normal((len(lens), h * w, cfg["in_channels"])).astype(np.float32)
    txt = rng.standard_normal((len(lens), max(lens), cfg["joint_attention_dim"])).astype(np.float32)
    mask = np.arange(max(lens))[None] < np.asarray(lens)[:, None]
    return x, np.asarray(sigmas, np.float32), txt * mask[..., None], mask


def torch_ref(model, x, s, txt, mask, grid):
    with torch.no_grad():
        return model(hidden_states=torch.from_numpy(x), timestep=torch.from_numpy(s),
                     encoder_hidden_states=torch.from_numpy(txt), encoder_hidden_states_mask=torch.from_numpy(mask),
                     img_shapes=[[(1, *grid)]] * len(x), return_dict=False)[0].numpy()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="diffusers pipeline folder (default: tiny offline pipeline)")
    p.add_argument("--tol", type=float, default=1e-5)
    args = p.parse_args(argv)
    if args.model is None:
        from jaxflow_bridge.families.qwen_image.tiny import tiny_pipeline_path
        args.model = tiny_pipeline_path()
    folder = args.model / "transformer"
    ref_model = QwenImageTransformer2DModel.from_pretrained(folder, dtype=torch.float32).eval()
    cfg = dict(ref_model.config)
    models = {d: load_transformer(folder, ModelOptions(dtype=d, param_dtype=d)) for d in ("float32", "bfloat16")}
    limits = {"float32": args.tol, "bfloat16": 2e-2}
    print(f"{'case':28s} {'dtype':9s} {'max|d|/max|ref|':>16s}")
    ok = True
    for i, (name, grid, lens, sigmas) in enumerate(CASES):
        x, s, txt, mask = inputs(cfg, grid, lens, sigmas, seed=i)
        ref = torch_ref(ref_model, x, s, txt, mask, grid)
        for dtype, model in models.items():
            out = np.asarray(model(jnp.asarray(x), jnp.asarray(s), jnp.asarray(txt), jnp.asarray(mask), grid),
                             np.float32)
            err = float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))
            ok &= err <= limits[dtype]
            print(f"{name:28s} {dtype:9s} {err:16.3e}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
