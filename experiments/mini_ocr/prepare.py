"""The torch-side steps of the mini OCR proof, each one command (`experiments/mini_ocr/run.sh` runs them in order):

    python -m experiments.mini_ocr.prepare data   --out OUT [--train 4000 --test 200 --variants 4]
    python -m experiments.mini_ocr.prepare vae    --out OUT [--steps 6000 --batch 16 --crop 32x64 --device cuda]
    python -m experiments.mini_ocr.prepare encode --out OUT [--device cuda]
    python -m experiments.mini_ocr.prepare bf16   --out OUT

data: OUT/data/{train,test}.txt (prompts), images.npy (uint8 renders of the train words, `variants` each),
index.npy (the word of each image), and the OCR reward of clean renders of the held-out words (ocr_clean.json).
vae: trains the VAE on images.npy, sets its latent statistics, scores OCR on its reconstructions of the held-out
renders (vae_report.json), writes the pipeline folder OUT/pipeline (random transformer of `--size`), and fails
when that OCR is below `--min-ocr` (the GPU run asks 0.8).
encode: OUT/data/latents.npy (packed normalised VAE means) and text.npz (prompt and negative embeddings).
bf16: OUT/pipeline_bf16, the (pretrained) pipeline folder in bf16, which the vLLM-Omni arms train on.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from experiments.mini_ocr.folder import SIZES, bf16_copy, build_folder, encode_text
from experiments.mini_ocr.render import HEIGHT, WIDTH, render_dataset
from experiments.mini_ocr.vae import build_vae, pack, posterior_means, reconstruct, set_latent_stats, train_vae
from experiments.mini_ocr.words import prompt, split, write_prompts
from jaxflow_bridge.rewards.ocr import OcrReward


def ocr_scores(images: np.ndarray, words: list[str]) -> dict:
    scores = OcrReward()(images, [prompt(w) for w in words])
    return dict(mean=float(scores.mean()), se=float(scores.std(ddof=1) / np.sqrt(len(scores))), n=len(scores))


def _words(out: Path) -> tuple[list[str], list[str]]:
    cfg = json.loads((out / "data" / "words.json").read_text())
    return split(cfg["train"], cfg["test"], cfg["seed"])


def step_data(out: Path, num_train: int, num_test: int, variants: int, seed: int) -> dict:
    data = out / "data"
    write_prompts(data, num_train, num_test, seed)
    (data / "words.json").write_text(json.dumps(dict(train=num_train, test=num_test, seed=seed)))
    train, test = split(num_train, num_test, seed)
    images, index = render_dataset(train, variants, HEIGHT, WIDTH, seed)
    np.save(data / "images.npy", images)
    np.save(data / "index.npy", index)
    report = ocr_scores(render_dataset(test, 1, HEIGHT, WIDTH, seed)[0], test)
    (data / "ocr_clean.json").write_text(json.dumps(report))
    return report


def fit_vae(images: np.ndarray, held_out: np.ndarray, words: list[str], steps: int, batch: int, device: str,
            max_minutes: float | None, seed: int, crop: tuple[int, int] | None = None, lr: float = 3e-4):
    """(the sign VAE trained on `images` with its latent statistics set, its report: steps, seconds, crop, lr,
    losses and `ocr_scores` of its reconstructions of `held_out`, the renders of `words`)."""
    vae = build_vae(seed)
    start = time.perf_counter()
    losses = train_vae(vae, images, steps, batch, lr, seed=seed, device=device, crop=crop,
                       max_seconds=None if max_minutes is None else 60 * max_minutes)
    set_latent_stats(vae, posterior_means(vae, images[::max(1, len(images) // 4096)], device=device))
    report = dict(steps=len(losses), seconds=round(time.perf_counter() - start, 1), crop=crop, lr=lr,
                  loss_first=losses[0], loss_last=float(np.mean(losses[-20:])),
                  loss_curve=[round(float(np.mean(losses[i:i + 50])), 5) for i in range(0, len(losses), 50)],
                  ocr_recon=ocr_scores(reconstruct(vae, held_out, device=device), words))
    return vae, report


def save_vae_report(out: Path, report: dict, min_ocr: float) -> dict:
    """Write OUT/vae_report.json; SystemExit when the OCR of reconstructions is below `min_ocr`."""
    (out / "vae_report.json").write_text(json.dumps(report, indent=1))
    if report["ocr_recon"]["mean"] < min_ocr:
        raise SystemExit(f"vae: OCR of reconstructions {report['ocr_recon']['mean']:.3f} < --min-ocr {min_ocr}: the "
                         f"VAE bounds everything after it; train it longer (--steps) or lower --min-ocr knowingly")
    return report


def step_vae(out: Path, steps: int, batch: int, size: str, device: str, max_minutes: float | None,
             seed: int, min_ocr: float = 0.0, crop: tuple[int, int] | None = None, lr: float = 3e-4) -> dict:
    _, test = _words(out)
    vae, report = fit_vae(np.load(out / "data" / "images.npy"), render_dataset(test, 1, HEIGHT, WIDTH, seed)[0], test,
                          steps, batch, device, max_minutes, seed, crop, lr)
    build_folder(out / "pipeline", vae.to("cpu"), size, seed)
    return save_vae_report(out, report, min_ocr)


def step_encode(out: Path, device: str) -> dict:
    from jaxflow_bridge.families.qwen_image.diffusers_pipeline import RolloutPipeline

    pipe = RolloutPipeline.from_pretrained(out / "pipeline", "float32", device)
    train, _ = _words(out)
    np.savez(out / "data" / "text.npz", **encode_text(pipe, [prompt(w) for w in train]))
    images = np.load(out / "data" / "images.npy")
    with torch.no_grad():
        latents = pack(posterior_means(pipe.vae, images, device=device), pipe.vae)
    np.save(out / "data" / "latents.npy", latents)
    return dict(latents=list(latents.shape), std=float(latents.std()))


def crop_size(text: str) -> tuple[int, int]:
    """--crop's HxW, e.g. 32x64 -> (32, 64)."""
    return tuple(int(v) for v in text.split("x"))


def add_vae_arguments(p: argparse.ArgumentParser, steps: int, batch: int) -> None:
    """The vae and encode steps' options (--crop parsed to (H, W)), `steps` and `batch` their defaults."""
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--size", default="mini", choices=sorted(SIZES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--lr", type=float, default=3e-4, help="vae: peak learning rate (cosine decay; 1e-3 stalls)")
    p.add_argument("--crop", default=None, type=crop_size,
                   help="vae: train on random HxW crops, e.g. 32x64 (cheaper steps)")
    p.add_argument("--min-ocr", type=float, default=0.0, help="vae: fail if OCR of reconstructions is lower")
    p.add_argument("--seed", type=int, default=0)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=("data", "vae", "encode", "bf16"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--train", type=int, default=4000)
    p.add_argument("--test", type=int, default=200)
    p.add_argument("--variants", type=int, default=4)
    add_vae_arguments(p, steps=3000, batch=64)
    a = p.parse_args(argv)
    if a.step == "data":
        report = step_data(a.out, a.train, a.test, a.variants, a.seed)
    elif a.step == "vae":
        report = step_vae(a.out, a.steps, a.batch, a.size, a.device, a.max_minutes, a.seed, a.min_ocr, a.crop, a.lr)
    elif a.step == "encode":
        report = step_encode(a.out, a.device)
    else:
        report = dict(folder=str(bf16_copy(a.out / "pipeline", a.out / "pipeline_bf16")))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
