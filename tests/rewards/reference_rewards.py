"""The reward models' reference code, transcribed (torch, float32) for the parity tests and
`python -m jaxflow_bench.reward_parity`: each function names its repository and file. Where the package installs
here (transformers) it is called; torchvision, open_clip, hpsv2, ImageReward, ftfy and torchmetrics do not install
offline, so the functions of theirs that the scores go through are written out. Not product code."""
from __future__ import annotations

import html
import math

import numpy as np
import regex
import torch
from PIL import Image

F = torch.nn.functional
OPENAI_MEAN, OPENAI_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


# --- pixels -----------------------------------------------------------------------------------------------------------

def _to_tensor(image: np.ndarray) -> torch.Tensor:
    """torchvision transforms.functional.to_tensor of an RGB PIL image: (3, H, W) float32 / 255."""
    return torch.from_numpy(np.array(image, copy=True)).permute(2, 0, 1).contiguous().to(torch.float32).div(255)


def _normalize(x: torch.Tensor, mean, std) -> torch.Tensor:
    """torchvision transforms.functional.normalize."""
    mean, std = torch.as_tensor(mean, dtype=x.dtype), torch.as_tensor(std, dtype=x.dtype)
    return x.sub(mean[:, None, None]).div(std[:, None, None])


def openai_clip_transform(image: np.ndarray, n_px: int, mean=OPENAI_MEAN, std=OPENAI_STD) -> torch.Tensor:
    """openai/CLIP clip/clip.py `_transform(n_px)` (ImageReward's ImageReward.py `_transform` is the same; LAION's
    improved-aesthetic-predictor simple_inference.py uses clip.load's): Resize(n_px, BICUBIC), CenterCrop(n_px),
    ToTensor, Normalize; torchvision's resize of a PIL image (`_compute_resized_output_size`: the short side to n_px,
    the long side int(n_px * long / short)) and center_crop (top int(round((H - n_px) / 2.0)))."""
    pil = Image.fromarray(image)
    w, h = pil.size
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = n_px, int(n_px * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    pil = pil.resize((new_w, new_h), Image.BICUBIC)
    top, left = int(round((new_h - n_px) / 2.0)), int(round((new_w - n_px) / 2.0))
    pil = pil.crop((left, top, left + n_px, top + n_px))
    return _normalize(_to_tensor(pil), mean, std)


def hpsv2_transform(image: np.ndarray, image_size: int, mean=OPENAI_MEAN, std=OPENAI_STD) -> torch.Tensor:
    """tgxs002/HPSv2 (866735e) hpsv2/src/open_clip/transform.py `image_transform(is_train=False,
    resize_longest_max=True)`, which hpsv2/img_score.py's `preprocess_val` is (light_augmentation=True): ToTensor,
    then `ResizeMaxSize` on the float tensor (torchvision's tensor resize: bicubic interpolate, align_corners False,
    antialias True, no clamp for floats), `F.pad(fill=0)`, Normalize."""
    x = _to_tensor(Image.fromarray(image))
    height, width = x.shape[1:]
    scale = image_size / float(max(height, width))
    if scale != 1.0:
        new_size = tuple(round(dim * scale) for dim in (height, width))
        x = F.interpolate(x[None], size=new_size, mode="bicubic", align_corners=False, antialias=True)[0]
        pad_h, pad_w = image_size - new_size[0], image_size - new_size[1]
        # torchvision's F.pad(padding=[left, top, right, bottom]) -> torch's (left, right, top, bottom)
        x = F.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=0)
    return _normalize(x, mean, std)


# --- open_clip's tokenizer (hpsv2's copy) -----------------------------------------------------------------------------

def bytes_to_unicode() -> dict[int, str]:
    """hpsv2/src/open_clip/tokenizer.py `bytes_to_unicode`."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class OpenClipTokenizer:
    """hpsv2/src/open_clip/tokenizer.py `SimpleTokenizer` and `tokenize` over a merges list; the vocabulary is built
    as there (bytes, bytes + "</w>", the merges, then start and end of text). `fix_text` stands for ftfy.fix_text."""

    def __init__(self, merges: list[tuple[str, str]], fix_text):
        self.byte_encoder, self.fix_text = bytes_to_unicode(), fix_text
        vocab = list(self.byte_encoder.values())
        vocab = vocab + [v + "</w>" for v in vocab] + ["".join(m) for m in merges]
        vocab += ["<start_of_text>", "<end_of_text>"]
        self.encoder = {v: i for i, v in enumerate(vocab)}
        self.ranks = {m: i for i, m in enumerate(merges)}
        self.pat = regex.compile(r"""<start_of_text>|<end_of_text>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|"""
                                 r"""[^\s\p{L}\p{N}]+""", regex.IGNORECASE)

    def bpe(self, token: str) -> list[str]:
        word = tuple(token[:-1]) + (token[-1] + "</w>",)
        while len(word) > 1:
            pairs = {(a, b) for a, b in zip(word, word[1:])}
            first, second = min(pairs, key=lambda p: self.ranks.get(p, math.inf))
            if (first, second) not in self.ranks:
                break
            out, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and word[i] == first and word[i + 1] == second:
                    out.append(first + second)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            word = tuple(out)
        return list(word)

    def encode(self, text: str) -> list[int]:
        text = html.unescape(html.unescape(self.fix_text(text))).strip()  # basic_clean
        text = regex.sub(r"\s+", " ", text).strip().lower()  # whitespace_clean, lower
        ids = []
        for token in regex.findall(self.pat, text):
            token = "".join(self.byte_encoder[b] for b in token.encode("utf-8"))
            ids.extend(self.encoder[t] for t in self.bpe(token))
        return ids

    def __call__(self, texts: list[str], context_length: int = 77) -> torch.Tensor:
        sot, eot = self.encoder["<start_of_text>"], self.encoder["<end_of_text>"]
        result = torch.zeros(len(texts), context_length, dtype=torch.long)
        for i, text in enumerate(texts):
            tokens = [sot] + self.encode(text) + [eot]
            if len(tokens) > context_length:
                tokens = tokens[:context_length]
                tokens[-1] = eot
            result[i, :len(tokens)] = torch.tensor(tokens)
        return result


# --- scores ---------------------------------------------------------------------------------------------------------

def clip_processor(folder):
    """CLIPProcessor.from_pretrained(folder) as the references ran it under transformers 4: the PIL image processor
    (transformers 5 picks its torchvision one when torchvision is installed) and the fast tokenizer."""
    import transformers

    images = getattr(transformers, "CLIPImageProcessorPil", transformers.CLIPImageProcessor)
    return transformers.CLIPProcessor(images.from_pretrained(folder),
                                      transformers.CLIPTokenizerFast.from_pretrained(folder))


@torch.no_grad()
def pickscore(model, processor, images: np.ndarray, prompts: list[str]) -> np.ndarray:
    """yangjie-cv/flow_grpo flow_grpo/pickscore_scorer.py `PickScoreScorer.__call__` (the processor is
    transformers' CLIPProcessor of CLIP-ViT-H-14-laion2B: `clip_processor`)."""
    image_inputs = processor(images=list(images), padding=True, truncation=True, max_length=77, return_tensors="pt")
    text_inputs = processor(text=prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
    image_embs = _pooled(model.get_image_features(pixel_values=image_inputs["pixel_values"]))
    image_embs = image_embs / image_embs.norm(p=2, dim=-1, keepdim=True)
    text_embs = _pooled(model.get_text_features(**text_inputs))
    text_embs = text_embs / text_embs.norm(p=2, dim=-1, keepdim=True)
    return (model.logit_scale.exp() * (text_embs @ image_embs.T)).diag().div(26).numpy()


@torch.no_grad()
def torchmetrics_clip_score(model, processor, images: np.ndarray, prompts: list[str]) -> np.ndarray:
    """Lightning-AI/torchmetrics src/torchmetrics/functional/multimodal/clip_score.py `_get_features` and
    `_clip_score_update` on uint8 (C, H, W) tensors, then `clip_score`'s max(score, 0), one image and prompt at a time
    (so the score is per sample)."""
    out = []
    for image, prompt in zip(images, prompts):
        pixels = processor(images=[torch.from_numpy(image).permute(2, 0, 1)], return_tensors="pt", padding=True)
        img = _pooled(model.get_image_features(pixels["pixel_values"]))
        text = processor(text=[prompt], return_tensors="pt", padding=True)
        n = model.config.text_config.max_position_embeddings
        ids, mask = text["input_ids"][..., :n], text["attention_mask"][..., :n]
        txt = _pooled(model.get_text_features(ids, mask))
        img, txt = img / img.norm(p=2, dim=-1, keepdim=True), txt / txt.norm(p=2, dim=-1, keepdim=True)
        score = 100 * (img * txt).sum(axis=-1)
        out.append(torch.max(score, torch.zeros_like(score)))
    return torch.cat(out).numpy()


@torch.no_grad()
def laion_aesthetic(model, mlp, images: np.ndarray, n_px: int) -> np.ndarray:
    """christophschuhmann/improved-aesthetic-predictor simple_inference.py: preprocess (OpenAI CLIP's), encode_image,
    `normalized` (numpy L2 norm, zeros kept), the MLP in float32."""
    out = []
    for image in images:
        features = _pooled(model.get_image_features(pixel_values=openai_clip_transform(image, n_px)[None])).numpy()
        l2 = np.atleast_1d(np.linalg.norm(features, 2, -1))
        l2[l2 == 0] = 1
        out.append(mlp(torch.from_numpy(features / np.expand_dims(l2, -1)).float()).squeeze(-1))
    return torch.cat(out).numpy()


@torch.no_grad()
def hpsv2_score(model, tokenizer: OpenClipTokenizer, images: np.ndarray, prompts: list[str], image_size: int):
    """hpsv2/img_score.py `score` per image: preprocess_val, the open_clip tokenizer, normalised features,
    diag(image_features @ text_features.T). `model(pixels, ids)` -> (image features, text features), normalised."""
    out = []
    for image, prompt in zip(images, prompts):
        image_features, text_features = model(hpsv2_transform(image, image_size)[None], tokenizer([prompt]))
        out.append(torch.diagonal(image_features @ text_features.T))
    return torch.cat(out).numpy()


def _pooled(out) -> torch.Tensor:
    """get_*_features: a tensor in transformers 4, an output with pooler_output in 5."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output
