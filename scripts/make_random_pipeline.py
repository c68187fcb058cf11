"""Write a Qwen-Image diffusers folder with random weights at the real size (no download, no checkpoint).

    python scripts/make_random_pipeline.py --out DIR [--no-transformer-weights] [--text-encoder full|short]

Real transformer (20.4B) and VAE configs; a text encoder of Qwen2.5-VL-7B's size (8.3B, 16.6 GB: what a run holds
with the released checkpoint), or with --text-encoder short its width but 2 layers (0.9 GB; folders written before
2026-11-26 had only this one) (jaxflow_bridge/families/qwen_image/full_size.py); our locally built tokenizer; the real
scheduler
config. bf16 safetensors, sharded. With --no-transformer-weights no transformer weights are written (17 GB in all
instead of 58): for `--config.model.init=random`, where the trainer and the rollout draw the transformer's weights
on their devices.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from jaxflow_bridge.families.qwen_image.full_size import TEXT_ENCODERS, full_size_pipeline
from jaxflow_bridge.families.qwen_image.tiny import save_folder


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--no-transformer-weights", action="store_true")
    p.add_argument("--text-encoder", choices=TEXT_ENCODERS, default="full")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not args.no_transformer_weights:
        save_folder(full_size_pipeline(device, text_encoder=args.text_encoder), args.out, max_shard_size="10GB")
    else:
        pipe = full_size_pipeline(device, transformer_device="meta", text_encoder=args.text_encoder)
        pipe.save_config(args.out)  # model_index.json
        for name in ("vae", "text_encoder", "tokenizer", "scheduler"):
            getattr(pipe, name).save_pretrained(args.out / name)
        pipe.transformer.save_config(args.out / "transformer")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
