"""Flow-matching pretraining of the Flax Qwen-Image-Edit transformer on the mini edit pairs: mini_ocr's loop
(`experiments/mini_ocr/pretrain.py`: rectified flow, logit-normal shifted sigma, CFG drop-out, AdamW, EMA) over
`EditFeed`, whose rows are (source latents, VL embeds of (source, instruction)) -> edited latents; the model reads the
source's latent tokens beside the noisy target's (`QwenImageEditTransformer`), and a dropped row falls back to its
own negative conditioning (the VL embeds of (source, " ")), as the edit rollout's true CFG runs it.

Inputs (written by `python -m experiments.mini_edit.prepare encode`): DATA/latents.npz (targets, sources: (N, S, 64)
float32) and DATA/text.npz (embeds, neg_embeds (N, L, D); mask, neg_mask (N, L)).

CLI: ``python -m experiments.mini_edit.pretrain --pipeline OUT/pipeline --data OUT/data --steps N [--batch 256]
[--max-minutes 8] [--dtype bfloat16] [--save-at 500,1000 --snapshots OUT/snapshots]`` (mini_ocr's options).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from experiments.mini_ocr import pretrain as base
from jaxflow.families.qwen_image_edit.transformer import QwenImageEditTransformer


class EditFeed:
    """The mini edit pretraining feed (`base.WordFeed`'s interface): `size` pairs of `tokens` latent tokens each;
    `batch(rows)` holds x0 (the edited signs' latents), refs (the sources', one reference a row) and each row's own
    text and negative embeds (`neg` is None)."""

    model_type = QwenImageEditTransformer
    neg = None

    def __init__(self, data: Path):
        latents, text = np.load(data / "latents.npz"), np.load(data / "text.npz")
        self.targets, self.sources = latents["targets"], latents["sources"]
        self.text = {k: text[k] for k in ("embeds", "mask", "neg_embeds", "neg_mask")}
        if not (len(self.targets) == len(self.sources) == len(self.text["embeds"])):
            raise ValueError(f"{data}: {len(self.targets)} targets, {len(self.sources)} sources and "
                             f"{len(self.text['embeds'])} text rows: re-run `python -m experiments.mini_edit.prepare "
                             f"encode`")
        self.size, self.tokens = len(self.targets), self.targets.shape[1]

    def batch(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        t = self.text
        return dict(x0=self.targets[rows], refs=self.sources[rows][:, None], txt=t["embeds"][rows],
                    mask=t["mask"][rows], neg_txt=t["neg_embeds"][rows], neg_mask=t["neg_mask"][rows])


def main(argv=None) -> None:
    base.main(argv, feed=EditFeed, description=__doc__)


if __name__ == "__main__":
    main()
