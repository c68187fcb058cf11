"""An edit dataset: JSONL rows {"image": path relative to the file, "instruction", "target"?} and its reference images
loaded at the sample size."""
import json

import numpy as np
import pytest
from PIL import Image

from jaxflow.run.data import load_prompts, load_reference


def write(tmp_path, rows):
    (tmp_path / "img").mkdir(exist_ok=True)
    Image.fromarray(np.full((20, 30, 3), (200, 10, 10), np.uint8)).save(tmp_path / "img" / "a.png")
    path = tmp_path / "edit.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_edit_rows_resolve_the_image_beside_the_file(tmp_path):
    path = write(tmp_path, [{"image": "img/a.png", "instruction": "write OPEN on it", "target": "OPEN"},
                            {"image": "img/a.png", "instruction": "make it blue"}])
    a, b = load_prompts(path, need_target=False)
    assert (a.prompt, a.target, a.image) == ("write OPEN on it", "OPEN", str(tmp_path / "img" / "a.png"))
    assert b.target is None and b.image == a.image
    ref = load_reference(a.image, 16, 24)
    assert ref.shape == (1, 16, 24, 3) and ref.dtype == np.uint8 and abs(int(ref[0, 8, 12, 0]) - 200) <= 2


@pytest.mark.parametrize("row, match", [
    ({"image": "img/missing.png", "instruction": "x"}, "is no file"),
    ({"image": "img/a.png", "instruction": " "}, "non-blank string 'instruction'"),
    ({"image": "img/a.png", "instruction": "x", "target": ""}, "'target' must be a non-blank string"),
])
def test_bad_edit_rows_name_the_line_and_the_key(tmp_path, row, match):
    with pytest.raises(ValueError, match=rf"edit.jsonl:1: .*{match}"):
        load_prompts(write(tmp_path, [row]), need_target=False)
