"""Write a Qwen-Image diffusers folder with random weights at the real size (no download, no checkpoint).

    python scripts/make_random_pipeline.py --out DIR

Real transformer (20.4B) and VAE configs; the text encoder has the real width (3584) but 2 layers (see
scripts/bench_rollout.py); our locally built tokenizer; the real scheduler config. bf16 safetensors, sharded.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rollout import full_size_pipeline  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    pipe = full_size_pipeline("cuda" if torch.cuda.is_available() else "cpu")
    pipe.save_pretrained(args.out, safe_serialization=True, max_shard_size="10GB")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
