r"""Write a BAGEL folder with random weights (no download, no checkpoint), for vLLM-Omni and the trainer to load.

    python scripts/make_random_bagel.py --out DIR [--seed 0] [--dtype bfloat16] [--size full|tiny]

--size full (default): BAGEL-7B-MoT's released geometry (jaxflow_bridge/families/bagel/full_size.py: both 28-layer
Qwen2.5-7B experts, the 152064-row embedding and LM head, the 26 stored layers of the SigLIP so400m ViT, the
connector, the 64 x 64 latent position table; 14.61B parameters): ema.safetensors 29.2 GB in bf16 (58.4 GB in
float32), 29.4 GB with the rest. Written one tensor at a time: under 5 GB of host memory (4.75 GB peak on the CPU
path). Each tensor is drawn on the GPU when there is one (the write is then disk-bound: about 1-3 minutes), else on
the CPU (about 3-4 minutes on 2 cores: 76M parameters/s). --size tiny: tiny_bagel.py's tiny folder (seconds).
Both: FLUX's autoencoder as ae.safetensors (84M parameters, 168 MB in bf16), tiny.py's tokenizer, the configs.
Then, e.g.:

    python -m jaxflow.train --config configs/bagel_ocr.py --config.model.path=DIR --config.rollout.engine=vllm_omni \
        --config.rollout.dtype=bfloat16 --config.rollout.device=cuda --config.rollout.num_gpus=1
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from jaxflow_bridge.families.bagel.full_size import FULL, build_bagel, parameter_count
from jaxflow_bridge.families.qwen_image.tiny import DTYPES
from jaxflow_bridge.families.bagel.tiny import build_tiny_bagel


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="output folder (absent or empty)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--size", choices=("full", "tiny"), default="full")
    args = p.parse_args(argv)
    start = time.perf_counter()
    try:
        if args.size == "tiny":
            build_tiny_bagel(args.out, args.seed, args.dtype)
        else:
            print(f"drawing {parameter_count(FULL) / 1e9:.2f}B parameters in {args.dtype} ...", flush=True)
            build_bagel(args.out, FULL, args.seed, args.dtype)
    except FileExistsError as exc:
        raise SystemExit(f"error: --out {exc}")
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"wrote {args.out} ({size / 1e9:.2f} GB) in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
