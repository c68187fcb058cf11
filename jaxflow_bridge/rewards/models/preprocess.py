"""What the reward models' reference code feeds them: pixels and prompt text, independent of the install.

Pixels (`Pixels`): one of three reference pipelines on uint8 (B, H, W, 3) images, always through PIL or torch (never
through transformers' image processors, whose backend changes with whether torchvision is installed):
- "floor": transformers' CLIPImageProcessor (PickScore, torchmetrics' CLIPScore): PIL bicubic resize of the short
  side to `size` (the long side int(size * long / short)), centre crop at ((H - size) // 2, (W - size) // 2).
- "round": torchvision's Resize + CenterCrop on a PIL image (OpenAI CLIP's `_transform`, used by LAION's aesthetic
  predictor and ImageReward): the same resize, the crop at int(round((H - size) / 2)), Python's round (half to
  even), so one pixel further when H - size = 3 (mod 4).
- "letterbox": hpsv2's validation transform (ToTensor, then open_clip's ResizeMaxSize): the float image resized so
  its long side is `size` (sides round(side * size / long)) by torch's antialiased bicubic interpolation, unclamped,
  then padded with black (left and top get half the padding, rounded down). An image whose long side is already
  `size` is padded here; hpsv2 leaves it unpadded (a non-square input its ViT refuses).
Each then scales to [0, 1] and normalises with the model's mean and std, in float32.

Prompts (`clean_prompt`): open_clip's tokenizer (hpsv2's) cleans text before its BPE: ftfy.fix_text, html.unescape
twice, whitespace runs to one space, stripped. ftfy is not needed here: its fixers for well-formed text are
transcribed (HTML entities unless the text holds "<", Latin ligatures, full and half width forms, curly quotes,
line breaks, terminal escapes, control characters, NFC, repeated to a fixed point); its mojibake repairs, which
change only text decoded in the wrong encoding, are not.
"""

from __future__ import annotations

import html
import re
import unicodedata

import numpy as np
import torch
from PIL import Image

CROPS = ("floor", "round", "letterbox")


class Pixels:
    """uint8 (B, H, W, 3) images -> float32 (B, 3, size, size) tensors, by the reference pipeline `crop` (CROPS)."""

    def __init__(self, size: int, mean, std, crop: str):
        if crop not in CROPS:
            raise ValueError(f"image preprocessing {crop!r}; choose one of {CROPS}")
        self.size, self.crop = int(size), crop
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)

    def __call__(self, images: np.ndarray) -> torch.Tensor:
        if self.crop == "letterbox":
            x = self.letterbox(torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() / 255)
        else:
            x = torch.from_numpy(np.stack([self.crop_square(self.resize_short(im)) for im in images]))
            x = x.permute(0, 3, 1, 2).float() / 255
        return (x - self.mean) / self.std

    def resize_short(self, image: np.ndarray) -> np.ndarray:
        """PIL bicubic resize: the short side to `size`, the long side int(size * long / short)."""
        h, w = image.shape[:2]
        long = int(self.size * max(h, w) / min(h, w))
        shape = (self.size, long) if h <= w else (long, self.size)
        return np.asarray(Image.fromarray(image).resize(shape[::-1], Image.Resampling.BICUBIC))

    def crop_square(self, image: np.ndarray) -> np.ndarray:
        h, w = image.shape[:2]
        if self.crop == "floor":
            top, left = (h - self.size) // 2, (w - self.size) // 2
        else:
            top, left = int(round((h - self.size) / 2)), int(round((w - self.size) / 2))
        return image[top:top + self.size, left:left + self.size]

    def letterbox(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        scale = self.size / max(h, w)
        nh, nw = round(h * scale), round(w * scale)
        if (nh, nw) != (h, w):
            x = torch.nn.functional.interpolate(x, size=(nh, nw), mode="bicubic", align_corners=False, antialias=True)
        ph, pw = self.size - nh, self.size - nw
        return torch.nn.functional.pad(x, (pw // 2, pw - pw // 2, ph // 2, ph - ph // 2), value=0.0)


# ftfy's tables (ftfy/chardata.py): ligatures, width forms, quotes, control characters
LIGATURES = str.maketrans({"Ĳ": "IJ", "ĳ": "ij", "ŉ": "ʼn", "Ǳ": "DZ", "ǲ": "Dz", "ǳ": "dz", "Ǆ": "DŽ", "ǅ": "Dž",
                           "ǆ": "dž", "Ǉ": "LJ", "ǈ": "Lj", "ǉ": "lj", "Ǌ": "NJ", "ǋ": "Nj", "ǌ": "nj", "ﬀ": "ff",
                           "ﬁ": "fi", "ﬂ": "fl", "ﬃ": "ffi", "ﬄ": "ffl", "ﬅ": "ſt", "ﬆ": "st"})
WIDTH = {0x3000: " ", **{c: unicodedata.normalize("NFKC", chr(c)) for c in range(0xFF01, 0xFFF0)
                         if unicodedata.normalize("NFKC", chr(c)) != chr(c)}}
CONTROL = dict.fromkeys([*range(0x00, 0x09), 0x0B, *range(0x0E, 0x20), 0x7F, *range(0x206A, 0x2070), 0xFEFF,
                         *range(0xFFF9, 0xFFFD)])
ENTITY = re.compile(r"&#?[0-9A-Za-z]{1,24};")
ANSI = re.compile("\033\\[((?:\\d|;)*)([a-zA-Z])")
BREAKS = str.maketrans({"\r": "\n", "\u2028": "\n", "\u2029": "\n", "\u0085": "\n"})


def _entity(match: re.Match) -> str:
    """One HTML entity as ftfy decodes it: a named one of HTML5 (or its upper-cased lower-case name), a numeric one
    only when it decodes whole."""
    text = match.group(0)
    name = text[1:]
    if name in html.entities.html5:
        return html.entities.html5[name]
    if not text.startswith("&#") and name.lower() in html.entities.html5 and name != name.lower():
        lower = name.lower()
        if name == lower.upper() and html.unescape(text) == text:
            return html.entities.html5[lower].upper()
        return text
    if text.startswith("&#"):
        out = html.unescape(text)
        return text if ";" in out else out
    return text


def fix_text(text: str) -> str:
    """ftfy.fix_text's fixers of well-formed text (see the module's docstring)."""
    while True:
        before = text
        if "<" not in text:
            text = ENTITY.sub(_entity, text)
        text = text.translate(LIGATURES).translate(WIDTH)
        text = re.sub("[\u02bc\u2018-\u201b]", "'", re.sub("[\u201c-\u201f]", '"', text))
        text = text.replace("\r\n", "\n").translate(BREAKS)
        text = ANSI.sub("", text).translate(CONTROL)
        text = unicodedata.normalize("NFC", text)
        if text == before:
            return text


def clean_prompt(text: str) -> str:
    """open_clip's basic_clean then whitespace_clean (the tokenizer lower-cases afterwards)."""
    text = html.unescape(html.unescape(fix_text(text))).strip()
    return re.sub(r"\s+", " ", text).strip()
