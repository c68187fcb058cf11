"""Write a Qwen-Image (or Qwen-Image-Edit) diffusers folder with random weights at the real size (no download, no
checkpoint).

    python scripts/make_random_pipeline.py --out DIR [--family qwen_image|qwen_image_edit] [--no-transformer-weights]
        [--text-encoder full|short]

Real transformer (20.4B) and VAE configs; a text encoder of Qwen2.5-VL-7B's size (8.3B, 16.6 GB: what a run holds
with the released checkpoint), or with --text-encoder short its width but 2 layers (0.9 GB; folders written before
2026-11-26 had only this one) (jaxflow_bridge/families/qwen_image/full_size.py); our locally built tokenizer; the real
scheduler config. --family qwen_image_edit: the edit pipeline of the same components, its tokenizer with the edit
templates' words and the released folder's processor/ (jaxflow_bridge/families/qwen_image_edit/full_size.py).
bf16 safetensors, sharded. With --no-transformer-weights no transformer weights are written (17 GB in all instead of
58): for `--config.model.init=random`, where the trainer and the rollout draw the transformer's weights on their
devices.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from jaxflow_bridge.families.qwen_image import full_size as qwen_image
from jaxflow_bridge.families.qwen_image.tiny import save_folder
from jaxflow_bridge.families.qwen_image_edit import full_size as qwen_image_edit

FAMILIES = {"qwen_image": qwen_image, "qwen_image_edit": qwen_image_edit}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--family", choices=tuple(FAMILIES), default="qwen_image")
    p.add_argument("--no-transformer-weights", action="store_true")
    p.add_argument("--text-encoder", choices=qwen_image.TEXT_ENCODERS, default="full")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    build = FAMILIES[args.family].full_size_pipeline
    if not args.no_transformer_weights:
        pipe = build(device, text_encoder=args.text_encoder)
        save_folder(pipe, args.out, max_shard_size="10GB")
    else:
        pipe = build(device, transformer_device="meta", text_encoder=args.text_encoder)
        pipe.save_config(args.out)  # model_index.json
        for name in ("vae", "text_encoder", "tokenizer", "scheduler"):
            getattr(pipe, name).save_pretrained(args.out / name)
        pipe.transformer.save_config(args.out / "transformer")
    if args.family == "qwen_image_edit":
        qwen_image_edit.finish_folder(args.out, pipe)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
