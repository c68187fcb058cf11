"""Black words on a white sign, drawn with Pillow's built-in scalable font (``ImageFont.load_default(size)``,
Pillow >= 10.1 with FreeType: no font file to install).

Each letter is centred in its own fixed-width cell, so letter k of an n-letter word sits at a position that depends
on (n, k) only: a proportional font laid out like a monospace one. A variant (`jitter`) shifts the whole word by a
few pixels, seeded, so one word has several training images.
"""
from __future__ import annotations

import functools

import numpy as np
from PIL import Image, ImageDraw, ImageFont

HEIGHT, WIDTH = 64, 128  # the mini model's image size (VAE factor 4: 16 x 32 latents, 8 x 16 packed tokens)


@functools.lru_cache(maxsize=8)
def _font(size: int):
    return ImageFont.load_default(size=size)


def layout(height: int, width: int) -> tuple[int, int]:
    """(font size, cell width) for an image size: 6 cells span 95% of the width at most, text ~45% of the height."""
    cell = int(width * 0.95) // 6
    return min(int(height * 0.45), int(cell * 1.25)), cell


def render(word: str, height: int = HEIGHT, width: int = WIDTH, shift: tuple[int, int] = (0, 0)) -> np.ndarray:
    """(height, width, 3) uint8 image of `word` centred (plus `shift` = (dx, dy) pixels)."""
    size, cell = layout(height, width)
    font = _font(size)
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    x0 = (width - cell * len(word)) / 2 + shift[0]
    top, bottom = draw.textbbox((0, 0), "H", font=font)[1::2]  # cap height: one baseline for every word
    y = (height - (bottom - top)) / 2 - top + shift[1]
    for k, letter in enumerate(word):
        left, _, right, _ = draw.textbbox((0, 0), letter, font=font)
        draw.text((x0 + k * cell + (cell - (right - left)) / 2 - left, y), letter, font=font, fill="black")
    return np.asarray(image)


def jitter(seed: int, word_index: int, variant: int, max_shift: int) -> tuple[int, int]:
    """Variant 0 is unshifted; others shift by up to `max_shift` pixels, a pure function of the arguments."""
    if variant == 0 or max_shift == 0:
        return 0, 0
    rng = np.random.default_rng([seed, word_index, variant])
    return tuple(int(v) for v in rng.integers(-max_shift, max_shift + 1, size=2))


def render_dataset(words: list[str], variants: int, height: int = HEIGHT, width: int = WIDTH, seed: int = 0,
                   max_shift: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """(images (N, H, W, 3) uint8, word index (N,) int32) with N = len(words) * variants, word-major."""
    images = np.empty((len(words) * variants, height, width, 3), np.uint8)
    index = np.repeat(np.arange(len(words), dtype=np.int32), variants)
    for i, word in enumerate(words):
        for v in range(variants):
            images[i * variants + v] = render(word, height, width, jitter(seed, i, v, max_shift))
    return images, index
