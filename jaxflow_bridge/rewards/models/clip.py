"""CLIP-based rewards through `transformers`: PickScore, CLIP score and the LAION aesthetic predictor.

Each loads a user's local checkpoint folders (nothing is downloaded) and scores uint8 (B, H, W, 3) images with their
prompts in batches of `batch_size`, on `device`; a sample's score depends on that sample alone. Each scores as its
reference code does: that code's image preprocessing (`preprocess.Pixels`, whose sizes, mean and std come from the
processor folder's preprocessor_config.json) and the fast CLIP tokenizer (the one PickScore's AutoProcessor and
torchmetrics' CLIPProcessor load; pinned, so transformers 4's slow CLIPTokenizer is never used).

`dtype` (float32, bfloat16 or float16) is the model's weights and activations; float32 by default, as flow_grpo's
scorers run (PickScore's own example and LAION's script run in float16 on a GPU, hpsv2 under float16 autocast).
Embeddings are normalised in float32.

- `PickScore` (Kirstain et al. 2023; flow_grpo's `PickScoreScorer`, a reward of its recipes):
  `logit_scale.exp() * cos(image embedding, text embedding) / 26`, i.e. roughly in [0, 1]. `path`: the PickScore_v1
  folder (a `CLIPModel`); `processor_path`: the folder of its processor (CLIP-ViT-H-14-laion2B's
  `preprocessor_config.json` and tokenizer files), by default `path`. Pixels "floor" (transformers' processor),
  prompts truncated to 77 tokens keeping the end-of-text token.
- `ClipScore`: torchmetrics' CLIPScore (what papers report) with a CLIP model (e.g. openai/clip-vit-large-patch14):
  100 * max(cos(image embedding, text embedding), 0), pixels "floor"; a prompt over 77 tokens is cut to its first
  77 (its end-of-text token dropped), as torchmetrics cuts it.
- `Aesthetic` (LAION's improved aesthetic predictor, as flow_grpo's `AestheticScorer`): an MLP 768-1024-128-64-16-1
  on the L2-normalised CLIP ViT-L/14 image embedding. `path`: the CLIP folder; `mlp_path`: the predictor's state
  dict (`sac+logos+ava1-l14-linearMSE.pth`, keys `layers.{0,2,4,6,7}.{weight,bias}`). Pixels "round" (LAION's script
  preprocesses with OpenAI CLIP's torchvision transform). Prompts are not used.
Never imports JAX.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from jaxflow_bridge.rewards.models.preprocess import Pixels

MODEL_FILES = ("config.json", ("model.safetensors", "pytorch_model.bin"))
PROCESSOR_FILES = ("preprocessor_config.json", "tokenizer_config.json", ("vocab.json", "tokenizer.json"))
PICKSCORE_SCALE = 26.0  # flow_grpo divides PickScore's logits by 26 ("norm to 0-1")
OPENAI_MEAN, OPENAI_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
BICUBIC = 3  # PIL's code, as preprocessor_config.json's "resample" names it


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


def processor_pixels(reward: str, folder: Path, crop: str) -> Pixels:
    """The `Pixels` of a transformers CLIP processor folder's preprocessor_config.json (transformers' defaults for
    what it leaves out); ValueError unless it describes a bicubic resize and a square crop of the resized side."""
    cfg = json.loads((folder / "preprocessor_config.json").read_text())
    size, crop_size = cfg.get("size", 224), cfg.get("crop_size", 224)
    size = size.get("shortest_edge") if isinstance(size, dict) else size
    crop_size = (crop_size.get("height"), crop_size.get("width")) if isinstance(crop_size, dict) else (crop_size,) * 2
    if size is None or crop_size != (size, size) or cfg.get("resample", BICUBIC) != BICUBIC:
        raise ValueError(f"reward {reward!r}: {folder / 'preprocessor_config.json'} is not a CLIP processor's "
                         f"(a bicubic resize of the short side to N, then an N x N crop): size {cfg.get('size')}, "
                         f"crop_size {cfg.get('crop_size')}, resample {cfg.get('resample')}")
    return Pixels(size, cfg.get("image_mean", OPENAI_MEAN), cfg.get("image_std", OPENAI_STD), crop)


class ClipReward:
    """A CLIPModel, its pixels (`crop`: preprocess.CROPS) and fast tokenizer from local folders; embeddings in
    float32, L2-normalised. Subclasses define `score(images, prompts)` -> (b,) float32 tensor for one batch."""

    splittable = True
    crop = "floor"
    keep_end_token = True  # a prompt over the context keeps its end-of-text token (False: cut as torchmetrics cuts)

    def __init__(self, path=None, processor_path=None, device: str = "cpu", dtype: str = "float32",
                 batch_size: int = 16, text: bool = True):
        from transformers import CLIPTokenizerFast

        self.require_model(path)  # the model's files first: a folder that lacks everything names them
        files = PROCESSOR_FILES if text else PROCESSOR_FILES[:1]
        proc_dir = require_files(self.name, "processor_path", processor_path or path, files)
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"reward {self.name!r}: dtype {dtype!r}; choose float32, bfloat16 or float16")
        self.device, self.dtype, self.batch_size = torch.device(device), getattr(torch, dtype), int(batch_size)
        self.model = self.load_model(path, self.dtype)
        self.model.eval().to(self.device)
        self.pixels = processor_pixels(self.name, proc_dir, self.crop)
        self.tokenizer = CLIPTokenizerFast.from_pretrained(proc_dir, local_files_only=True) if text else None

    def require_model(self, path) -> None:
        """FileNotFoundError naming what the model's checkpoint lacks (a transformers CLIPModel folder here)."""
        require_files(self.name, "path", path, MODEL_FILES)

    def load_model(self, path, dtype: torch.dtype):
        """The CLIPModel of the transformers folder `path`."""
        from transformers import CLIPModel

        folder = require_files(self.name, "path", path, MODEL_FILES)
        return CLIPModel.from_pretrained(folder, local_files_only=True, torch_dtype=dtype)

    def tokens(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """input_ids and attention_mask of the prompts, padded to the longest, at most the model's context long."""
        context = self.model.config.text_config.max_position_embeddings
        if self.keep_end_token:
            return dict(self.tokenizer(list(prompts), padding=True, truncation=True, max_length=context,
                                       return_tensors="pt"))
        tok = self.tokenizer(list(prompts), padding=True, return_tensors="pt")
        return {k: tok[k][:, :context] for k in ("input_ids", "attention_mask")}

    def embed(self, images: np.ndarray, prompts: Sequence[str] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        image = self.model.get_image_features(pixel_values=self.pixels(images).to(self.device, self.dtype))
        text = None
        if prompts is not None:
            text = self.model.get_text_features(**{k: v.to(self.device) for k, v in self.tokens(prompts).items()})
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


class PickScore(ClipReward):
    name = "pickscore"

    def score(self, images, prompts):
        image, text = self.embed(images, prompts)
        return self.model.logit_scale.exp().float() * (image * text).sum(-1) / PICKSCORE_SCALE


class ClipScore(ClipReward):
    name = "clip_score"
    keep_end_token = False

    def score(self, images, prompts):
        image, text = self.embed(images, prompts)
        return 100 * (image * text).sum(-1).clamp(min=0)


class Aesthetic(ClipReward):
    name = "aesthetic"
    crop = "round"

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
