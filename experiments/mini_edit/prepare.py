"""The torch-side steps of the mini edit proof after its data (`experiments/mini_edit/run.sh` runs them in order):

    python -m experiments.mini_edit.prepare vae    --out OUT [--steps 6000 --batch 16 --crop 32x64 --device cuda]
    python -m experiments.mini_edit.prepare encode --out OUT [--device cuda]

vae: mini_ocr's sign VAE (`experiments/mini_ocr/vae.py`, the same renderer) trained on OUT/data/pairs.npz's source and
edited signs; its latent statistics set, OCR scored on its reconstructions of the held-out source signs
(vae_report.json), then the pipeline folder OUT/pipeline: the tiny Qwen-Image-Edit folder
(`jaxflow_bridge/families/qwen_image_edit/tiny.py`: VL text encoder, tokenizer, image processor, scheduler) with this
VAE and a seeded random transformer of mini_ocr's `SIZES[size]`. Fails when that OCR is below `--min-ocr`.
encode: OUT/data/latents.npz (targets and sources (N, S, 64): packed normalised VAE latents, the edit rollout's
`reference_latents`) and OUT/data/text.npz (embeds, mask: each pair's VL embeds over (source, instruction); neg_embeds,
neg_mask: over (source, the negative prompt " "); all right-padded to one length), through the rollout pipeline's own
conditioning path (`RolloutPipeline.encode_with_images`).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from experiments.mini_ocr.folder import SIZES
from experiments.mini_ocr.prepare import ocr_scores
from experiments.mini_ocr.render import HEIGHT, WIDTH
from experiments.mini_ocr.vae import build_vae, posterior_means, reconstruct, set_latent_stats, train_vae
from jaxflow.run.data import load_prompts, load_reference
from jaxflow_bridge.families.qwen_image_edit.tiny import build_tiny_pipeline
from jaxflow_bridge.rewards.text import extract_target

NEGATIVE = " "  # the rollout's negative prompt (SamplingParams.negative_prompt)


def held_out_sources(data: Path) -> tuple[np.ndarray, list[str]]:
    """The held-out source signs (uint8 (N, H, W, 3)) and their words (each instruction's first quoted word)."""
    items = load_prompts(data / "test.jsonl")
    return (np.concatenate([load_reference(it.image, HEIGHT, WIDTH) for it in items]),
            [extract_target(it.prompt) for it in items])


def step_vae(out: Path, steps: int, batch: int, size: str, device: str, max_minutes: float | None, seed: int,
             min_ocr: float = 0.0, crop: tuple[int, int] | None = None, lr: float = 3e-4) -> dict:
    pairs = np.load(out / "data" / "pairs.npz")
    images = np.concatenate([pairs["sources"], pairs["edited"]])
    vae = build_vae(seed)
    start = time.perf_counter()
    losses = train_vae(vae, images, steps, batch, lr, seed=seed, device=device, crop=crop,
                       max_seconds=None if max_minutes is None else 60 * max_minutes)
    set_latent_stats(vae, posterior_means(vae, images[::max(1, len(images) // 4096)], device=device))
    held_out, words = held_out_sources(out / "data")
    report = dict(steps=len(losses), seconds=round(time.perf_counter() - start, 1), crop=crop, lr=lr,
                  loss_first=losses[0], loss_last=float(np.mean(losses[-20:])),
                  ocr_recon=ocr_scores(reconstruct(vae, held_out, device=device), words))
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    build_tiny_pipeline(out / "pipeline", seed, transformer_config=SIZES[size], vae=vae.to("cpu"))
    (out / "vae_report.json").write_text(json.dumps(report, indent=1))
    if report["ocr_recon"]["mean"] < min_ocr:
        raise SystemExit(f"vae: OCR of reconstructions {report['ocr_recon']['mean']:.3f} < --min-ocr {min_ocr}: the "
                         f"VAE bounds everything after it; train it longer (--steps) or lower --min-ocr knowingly")
    return report


def pad_embeds(embeds: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """(L_i, D) embeds -> float32 (N, L, D) right-padded to the longest, and its (N, L) bool mask."""
    length = max(len(e) for e in embeds)
    out = np.zeros((len(embeds), length, embeds[0].shape[-1]), np.float32)
    mask = np.zeros((len(embeds), length), bool)
    for i, e in enumerate(embeds):
        out[i, :len(e)] = e.float().cpu().numpy()
        mask[i, :len(e)] = True
    return out, mask


def step_encode(out: Path, device: str, chunk: int = 256) -> dict:
    from jaxflow_bridge.families.qwen_image_edit.diffusers_pipeline import RolloutPipeline

    pipe = RolloutPipeline.from_pretrained(out / "pipeline", "float32", device)
    pairs = np.load(out / "data" / "pairs.npz")
    sources, edited, instructions = pairs["sources"], pairs["edited"], [str(s) for s in pairs["instructions"]]
    embeds, negatives = [], []
    for i in range(0, len(sources), chunk):
        refs = [s[None] for s in sources[i:i + chunk]]
        texts = instructions[i:i + chunk]
        both = pipe.encode_with_images(texts + [NEGATIVE] * len(texts), refs + refs)
        embeds += both[:len(texts)]
        negatives += both[len(texts):]
    txt, mask = pad_embeds(embeds + negatives)  # one length for both: the pretraining swaps one for the other
    np.savez(out / "data" / "text.npz", embeds=txt[:len(embeds)], mask=mask[:len(embeds)],
             neg_embeds=txt[len(embeds):], neg_mask=mask[len(embeds):])

    def latents(images):
        return np.concatenate([pipe.reference_latents(images[i:i + chunk]).cpu().numpy()
                               for i in range(0, len(images), chunk)])
    targets = latents(edited)
    np.savez(out / "data" / "latents.npz", targets=targets, sources=latents(sources))
    return dict(latents=list(targets.shape), std=float(targets.std()), text=list(txt.shape))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=("vae", "encode"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--size", default="mini", choices=sorted(SIZES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--lr", type=float, default=3e-4, help="vae: peak learning rate (cosine decay)")
    p.add_argument("--crop", default=None, help="vae: train on random HxW crops, e.g. 32x64 (cheaper steps)")
    p.add_argument("--min-ocr", type=float, default=0.0, help="vae: fail if OCR of reconstructions is lower")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.step == "vae":
        report = step_vae(a.out, a.steps, a.batch, a.size, a.device, a.max_minutes, a.seed, a.min_ocr,
                          tuple(int(v) for v in a.crop.split("x")) if a.crop else None, a.lr)
    else:
        report = step_encode(a.out, a.device)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
