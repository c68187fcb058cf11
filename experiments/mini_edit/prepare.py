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
from pathlib import Path

import numpy as np
import torch

from experiments.mini_ocr.folder import SIZES
from experiments.mini_ocr.prepare import add_vae_arguments, fit_vae, save_vae_report
from experiments.mini_ocr.render import HEIGHT, WIDTH
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
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    pairs = np.load(out / "data" / "pairs.npz")
    vae, report = fit_vae(np.concatenate([pairs["sources"], pairs["edited"]]), *held_out_sources(out / "data"),
                          steps, batch, device, max_minutes, seed, crop, lr)
    build_tiny_pipeline(out / "pipeline", seed, transformer_config=SIZES[size], vae=vae.to("cpu"))
    return save_vae_report(out, report, min_ocr)


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
    add_vae_arguments(p, steps=6000, batch=16)
    a = p.parse_args(argv)
    if a.step == "vae":
        report = step_vae(a.out, a.steps, a.batch, a.size, a.device, a.max_minutes, a.seed, a.min_ocr, a.crop, a.lr)
    else:
        report = step_encode(a.out, a.device)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
