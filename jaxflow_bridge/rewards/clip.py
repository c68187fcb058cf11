"""CLIP-based rewards through `transformers`: PickScore, CLIP score and the LAION aesthetic predictor.

Each loads a user's local checkpoint folders (nothing is downloaded) and scores uint8 (B, H, W, 3) images with their
prompts in batches of `batch_size`, in `dtype` on `device`; a sample's score depends on that sample alone.

- `PickScore` (Kirstain et al. 2023; flow_grpo's `PickScoreScorer`, a reward of its recipes):
  `logit_scale.exp() * cos(image embedding, text embedding) / 26`, i.e. roughly in [0, 1]. `path`: the PickScore_v1
  folder (a `CLIPModel`); `processor_path`: the folder of its processor (CLIP-ViT-H-14-laion2B's
  `preprocessor_config.json` and tokenizer files), by default `path`.
- `ClipScore`: cos(image embedding, text embedding) of a CLIP model (e.g. openai/clip-vit-large-patch14), in [-1, 1].
- `Aesthetic` (LAION's improved aesthetic predictor, as flow_grpo's `AestheticScorer`): an MLP 768-1024-128-64-16-1
  on the L2-normalised CLIP ViT-L/14 image embedding. `path`: the CLIP folder; `mlp_path`: the predictor's state
  dict (`sac+logos+ava1-l14-linearMSE.pth`, keys `layers.{0,2,4,6,7}.{weight,bias}`). Prompts are not used.
Never imports JAX.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

MODEL_FILES = ("config.json", ("model.safetensors", "pytorch_model.bin"))
PROCESSOR_FILES = ("preprocessor_config.json", "tokenizer_config.json", ("vocab.json", "tokenizer.json"))
PICKSCORE_SCALE = 26.0  # flow_grpo divides PickScore's logits by 26 ("norm to 0-1")


def require_files(reward: str, key: str, folder, files) -> Path:
    """`folder` as a Path; FileNotFoundError naming the option and every missing file (an entry that is a tuple
    needs one of its names)."""
    if not folder:
        raise FileNotFoundError(f"reward {reward!r} needs reward.options.{reward}.{key}: a local folder")
    folder = Path(folder)
    missing = [" or ".join(f) if isinstance(f, tuple) else f for f in files
               if not any((folder / name).is_file() for name in (f if isinstance(f, tuple) else (f,)))]
    if missing:
        raise FileNotFoundError(f"reward {reward!r}: reward.options.{reward}.{key}={folder} lacks {', '.join(missing)}")
    return folder


class _Clip:
    """A CLIPModel and its processor from local folders; embeddings in float32, L2-normalised. Subclasses define
    `score(images, prompts)` -> (b,) float32 tensor for one batch."""

    splittable = True

    def __init__(self, path=None, processor_path=None, device: str = "cpu", dtype: str = "float32",
                 batch_size: int = 16, text: bool = True):
        from transformers import CLIPImageProcessor, CLIPTokenizer

        self.require_model(path)  # the model's files first: a folder that lacks everything names them
        files = PROCESSOR_FILES if text else PROCESSOR_FILES[:1]
        proc_dir = require_files(self.name, "processor_path", processor_path or path, files)
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"reward {self.name!r}: dtype {dtype!r}; choose float32, bfloat16 or float16")
        self.device, self.dtype, self.batch_size = torch.device(device), getattr(torch, dtype), int(batch_size)
        self.model = self.load_model(path, self.dtype)
        self.model.eval().to(self.device)
        self.images = CLIPImageProcessor.from_pretrained(proc_dir, local_files_only=True)
        self.tokenizer = CLIPTokenizer.from_pretrained(proc_dir, local_files_only=True) if text else None

    def require_model(self, path) -> None:
        """FileNotFoundError naming what the model's checkpoint lacks (a transformers CLIPModel folder here)."""
        require_files(self.name, "path", path, MODEL_FILES)

    def load_model(self, path, dtype: torch.dtype):
        """The CLIPModel of the transformers folder `path`."""
        from transformers import CLIPModel

        folder = require_files(self.name, "path", path, MODEL_FILES)
        return CLIPModel.from_pretrained(folder, local_files_only=True, torch_dtype=dtype)

    def embed(self, images: np.ndarray, prompts: Sequence[str] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        pixels = self.images(images=list(images), return_tensors="pt")["pixel_values"]
        image = self.model.get_image_features(pixel_values=pixels.to(self.device, self.dtype))
        text = None
        if prompts is not None:
            tok = self.tokenizer(list(prompts), padding=True, truncation=True,
                                 max_length=self.model.config.text_config.max_position_embeddings, return_tensors="pt")
            text = self.model.get_text_features(**{k: v.to(self.device) for k, v in tok.items()})
            text = torch.nn.functional.normalize(_features(text).float(), dim=-1)
        return torch.nn.functional.normalize(_features(image).float(), dim=-1), text

    @torch.inference_mode()
    def __call__(self, images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
        if len(images) != len(prompts):
            raise ValueError(f"reward {self.name!r}: {len(images)} images but {len(prompts)} prompts")
        out = [self.score(images[i:i + self.batch_size], list(prompts[i:i + self.batch_size]))
               for i in range(0, len(images), self.batch_size)]
        return torch.cat(out).cpu().numpy().astype(np.float32) if out else np.zeros(0, np.float32)


def _features(out) -> torch.Tensor:
    """get_*_features returns a tensor in transformers 4 and an output object with pooler_output in 5."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


class PickScore(_Clip):
    name = "pickscore"

    def score(self, images, prompts):
        image, text = self.embed(images, prompts)
        return self.model.logit_scale.exp().float() * (image * text).sum(-1) / PICKSCORE_SCALE


class ClipScore(_Clip):
    name = "clip_score"

    def score(self, images, prompts):
        image, text = self.embed(images, prompts)
        return (image * text).sum(-1)


class Aesthetic(_Clip):
    name = "aesthetic"

    def __init__(self, path=None, mlp_path=None, processor_path=None, device: str = "cpu", dtype: str = "float32",
                 batch_size: int = 16):
        super().__init__(path, processor_path, device, dtype, batch_size, text=False)
        if not mlp_path or not Path(mlp_path).is_file():
            raise FileNotFoundError(f"reward 'aesthetic' needs reward.options.aesthetic.mlp_path: the predictor's "
                                    f"state dict (sac+logos+ava1-l14-linearMSE.pth), got {mlp_path!r}")
        self.mlp = AestheticMLP(self.model.config.projection_dim)
        self.mlp.load_state_dict(torch.load(mlp_path, map_location="cpu", weights_only=True))
        self.mlp.eval().to(self.device)

    def score(self, images, prompts):
        return self.mlp(self.embed(images, None)[0]).squeeze(-1)


class AestheticMLP(torch.nn.Module):
    """The LAION predictor: `layers`, dropouts at 1, 3 and 5, so its state-dict keys are layers.{0,2,4,6,7}.*."""

    def __init__(self, dim: int = 768):
        super().__init__()
        L, D = torch.nn.Linear, torch.nn.Dropout
        self.layers = torch.nn.Sequential(L(dim, 1024), D(0.2), L(1024, 128), D(0.2), L(128, 64), D(0.1), L(64, 16),
                                          L(16, 1))

    def forward(self, x):
        return self.layers(x)
