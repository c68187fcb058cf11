"""The reward models' precision at full size: PickScore and HPS v2.1 in bfloat16 and float16 against float32, on one
device, with seeded random checkpoints written in the released layouts (no weights download here).

Both are CLIP ViT-H/14 (`hps.VIT_H_14`, open_clip's sizes: vision 1280 wide x 32 layers, patch 14, 224 px; text
1024 x 24; embeddings 1024), the sizes of the released yuvalkirstain/PickScore_v1 (a transformers CLIPModel folder)
and of HPS_v2.1_compressed.pt (open_clip's state dict). Each checkpoint is a CLIPModel built on `--device` with
transformers' own initialisation (seeded, logit scale at 100 as trained CLIP models hold it), saved as PickScore's
folder, and, renamed into open_clip's keys (`clip_to_open_clip`), as HPS's file; a processor folder (CLIP's 224 px
preprocessing, a CLIP BPE vocabulary learned offline: its tokens use the first rows of the text tower's 49408) serves
both. Each reward is then built by the registry from those files, in float32, bfloat16 and float16 in turn (the
`dtype` option), and scores the same PAIRS non-square image/prompt pairs (4 sizes, one batch a size).

Per reward: `max_abs_delta_bf16` and `max_abs_delta_fp16` (the scores against float32's), `score_spread` (max - min
of float32's scores, for scale), and `seconds_fp32` / `seconds_bf16` / `seconds_fp16` (scoring the pairs after one
warm-up batch, loading excluded). Random weights are not trained ones: a trained model's outlier weights and sharper
embeddings may cost more precision than these. `--size tiny` builds the same at reward_checkpoints' small sizes
(tests/bench/test_reward_precision.py runs it on the CPU).

    PYTHONPATH=$PWD HF_HUB_OFFLINE=1 python -m jaxflow_bench.reward_precision --out benchmarks/results  # one GPU
    PYTHONPATH=$PWD python -m jaxflow_bench.reward_precision --size tiny --device cpu
"""
from __future__ import annotations

import argparse
import gc
import math
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from jaxflow_bench.reward_parity import PROMPTS, image
from jaxflow_bench.results import write_result
from jaxflow_bridge.rewards.models import hps
from jaxflow_bridge.rewards.multi import build_reward
from tests.rewards import reward_checkpoints as ckpt

SIZES = {"full": hps.VIT_H_14, "tiny": ckpt.HPS_ARCH}
DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
SHAPES = [(512, 768), (768, 512), (480, 853), (1024, 576)]  # (H, W): landscape, portrait, 16:9 both ways
PAIRS = 16
LOGIT_SCALE = math.log(100.0)  # trained CLIP models sit at open_clip's clamp, exp(logit_scale) = 100

# CLIPModel's names -> open_clip CLIP's, outside the blocks (HPS_v2.1_compressed.pt's keys)
OPEN_CLIP_NAMES = {"vision_model.embeddings.patch_embedding.weight": "visual.conv1.weight",
                   "vision_model.embeddings.class_embedding": "visual.class_embedding",
                   "vision_model.embeddings.position_embedding.weight": "visual.positional_embedding",
                   "vision_model.pre_layrnorm": "visual.ln_pre", "vision_model.post_layernorm": "visual.ln_post",
                   "text_model.embeddings.token_embedding.weight": "token_embedding.weight",
                   "text_model.embeddings.position_embedding.weight": "positional_embedding",
                   "text_model.final_layer_norm": "ln_final", "logit_scale": "logit_scale"}
BLOCK_NAMES = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "self_attn.out_proj": "attn.out_proj",
               "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}
BLOCK = re.compile(r"(vision_model|text_model)\.encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$")
TOWERS = {"vision_model": "visual.transformer", "text_model": "transformer"}


def clip_to_open_clip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A CLIPModel state dict in open_clip CLIP's layout: `hps.open_clip_to_clip` undone (q, k, v fused into the
    in-projection, the projections as matrices applied x @ proj); ValueError naming keys it does not know."""
    out, qkv, unknown = {}, {}, []
    for key, value in state.items():
        block = BLOCK.match(key)
        stem, _, leaf = key.rpartition(".")
        if key in ("visual_projection.weight", "text_projection.weight"):
            out["visual.proj" if key.startswith("visual") else "text_projection"] = value.t().contiguous()
        elif key in OPEN_CLIP_NAMES:
            out[OPEN_CLIP_NAMES[key]] = value
        elif stem in OPEN_CLIP_NAMES:
            out[f"{OPEN_CLIP_NAMES[stem]}.{leaf}"] = value
        elif block and block.group(3) in BLOCK_NAMES:
            tower, i, part, leaf = block.groups()
            out[f"{TOWERS[tower]}.resblocks.{i}.{BLOCK_NAMES[part]}.{leaf}"] = value
        elif block and block.group(3) in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            tower, i, part, leaf = block.groups()
            fused = qkv.setdefault(f"{TOWERS[tower]}.resblocks.{i}.attn.in_proj_{leaf}", {})
            fused[part.removeprefix("self_attn.")[0]] = value
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"{len(unknown)} keys are not CLIPModel's, e.g. {unknown[:3]}")
    out.update({name: torch.cat([parts[p] for p in "qkv"]) for name, parts in qkv.items()})
    return out


def write_checkpoints(folder: Path, size: str, device: str) -> dict:
    """PickScore's model folder, HPS's checkpoint file and their processor folder under `folder`, each model a
    seeded random CLIP at `size` built on `device`; the rewards' options ({name: options})."""
    from transformers import CLIPImageProcessor, CLIPModel

    processor = folder / "processor"
    n = ckpt.write_clip_tokenizer(processor, ckpt.learn_merges(ckpt.CORPUS, 300))
    base = SIZES[size]
    side = base["vision"]["image_size"]
    CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side}).save_pretrained(
        processor)
    text = {**base["text"], "vocab_size": max(base["text"]["vocab_size"], n), "bos_token_id": n - 2,
            "eos_token_id": n - 1}
    arch = {**base, "text": text}
    for seed, name in enumerate(("pickscore", "hps")):
        torch.manual_seed(seed)
        with torch.device(device):
            model = CLIPModel(hps.clip_config(arch, logit_scale_init_value=LOGIT_SCALE)).eval()
        if name == "pickscore":
            model.save_pretrained(folder / name, max_shard_size="50GB")  # one model.safetensors, as released
        else:
            state = clip_to_open_clip(model.state_dict())
            torch.save({"state_dict": {k: v.cpu() for k, v in state.items()}}, folder / "hps.pt")
        del model
        _release(device)
    common = {"processor_path": str(processor), "device": device}
    return {"pickscore": {"path": str(folder / "pickscore"), **common},
            "hps": {"path": str(folder / "hps.pt"), "arch": arch, **common}}


def pairs(count: int) -> list[tuple[np.ndarray, list[str]]]:
    """`count` seeded image/prompt pairs, grouped by image size: [(images (k, H, W, 3) uint8, prompts)]."""
    groups: dict[tuple[int, int], tuple[list, list]] = {}
    for i in range(count):
        shape = SHAPES[i % len(SHAPES)]
        images, prompts = groups.setdefault(shape, ([], []))
        images.append(image(shape, i))
        prompts.append(PROMPTS[i % len(PROMPTS)])
    return [(np.stack(images), prompts) for images, prompts in groups.values()]


def _release(device: str) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def score(name: str, options: dict, dtype: str, batches) -> tuple[np.ndarray, float]:
    """The reward `name` built in `dtype`: its scores of every batch and the seconds they took after a warm-up."""
    reward = build_reward({name: 1.0}, **{name: {**options, "dtype": dtype}}).rewards[name]
    reward(*batches[0])
    start = time.perf_counter()
    scores = np.concatenate([reward(images, prompts) for images, prompts in batches])  # numpy: synchronised
    seconds = time.perf_counter() - start
    del reward
    _release(options["device"])
    return scores, seconds


def figures(folder: Path, size: str = "full", device: str = "cuda", count: int = PAIRS) -> dict:
    options = write_checkpoints(folder, size, device)
    batches = pairs(count)
    out = {}
    for name, opts in options.items():
        scores = {}
        for dtype, short in DTYPES.items():
            scores[dtype], out[f"{name}/seconds_{short}"] = score(name, opts, dtype, batches)
        out[f"{name}/score_spread"] = float(np.ptp(scores["float32"]))
        for dtype in ("bfloat16", "float16"):
            out[f"{name}/max_abs_delta_{DTYPES[dtype]}"] = float(np.abs(scores[dtype] - scores["float32"]).max())
    out["pairs"] = count
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="full", help="full: CLIP ViT-H/14; tiny: for tests")
    p.add_argument("--device", default="cuda")
    p.add_argument("--pairs", type=int, default=PAIRS, help="image/prompt pairs scored in each dtype")
    p.add_argument("--out", default=None, help="write OUT/reward_precision.json (else print only)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        flat = figures(Path(folder), args.size, args.device, args.pairs)
    for k, v in flat.items():
        print(f"{k}: {v:.3g}")
    if args.out:
        a = SIZES[args.size]
        command = shlex.join(["python", "-m", "jaxflow_bench.reward_precision", *argv])
        print(write_result(args.out, "reward_precision", flat, command=command, extra={
            "size": args.size, "torch": torch.__version__,
            "inputs": f"{args.pairs} seeded images of sizes {SHAPES} (one batch a size) with reward_parity's prompts",
            "models": f"seeded random CLIPs, transformers' initialisation, logit scale 100: vision "
                      f"{a['vision']['hidden_size']} x {a['vision']['num_hidden_layers']} layers, patch "
                      f"{a['vision']['patch_size']}, {a['vision']['image_size']} px; text {a['text']['hidden_size']} "
                      f"x {a['text']['num_hidden_layers']}; PickScore as a CLIPModel folder, HPS v2.1 as open_clip's "
                      f"state dict"}))


if __name__ == "__main__":
    main()
