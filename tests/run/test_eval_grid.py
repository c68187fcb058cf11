"""Eval grid captions wrap at word boundaries; a caption too long for its lines ends in ' ...', never mid-word."""
import numpy as np
from PIL import Image

from jaxflow.run.metrics_log import caption_lines, image_grid

PROMPT = '0.42 a hot air balloon with "MIDNIGHT VALLEY" written on the envelope above a misty lake at dawn'


def test_captions_wrap_and_end_at_word_boundaries():
    lines = caption_lines(PROMPT, 26, 3)
    words = set(PROMPT.split())
    assert len(lines) == 3 and all(len(line) <= 26 for line in lines) and lines[-1].endswith(" ...")
    assert all(w in words for line in lines for w in line.removesuffix(" ...").split()), lines
    assert caption_lines("0.10 short", 26, 3) == ["0.10 short"]


def test_image_grid_writes_captioned_cells(tmp_path):
    images = np.zeros((2, 40, 72, 3), np.uint8)
    image_grid(images, [PROMPT, "0.1 x"], tmp_path / "g.png", columns=2)
    assert Image.open(tmp_path / "g.png").size == (2 * 160, 40 + 40)
