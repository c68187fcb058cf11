"""The edit-OCR reward on rendered sign edits, and the conditioned-reward contract's checks (rewards/base.py)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from experiments.mini_edit.signs import SignEdit
from experiments.mini_ocr.render import render
from jaxflow_bridge.rewards.base import check_sources
from jaxflow_bridge.rewards.edit_ocr import EditOcrReward, outside_change, text_region
from jaxflow_bridge.rewards.registry import REGISTRY

EDIT = SignEdit("QNHIB", "SYQJ", (2, -1))


def tinted(image: np.ndarray, colour=(190, 215, 250)) -> np.ndarray:
    """The sign with its white background repainted (the letters left as they are)."""
    out = image.copy()
    out[(image > 240).all(-1)] = colour
    return out


def test_edit_ocr_ranks_the_clean_edit_first():
    source, edited = EDIT.images()
    candidates = {
        "correct": edited,
        "wrong_word": render("KFDM", shift=EDIT.shift),
        "background_changed": tinted(edited),
        "identity": source,
    }
    reward = REGISTRY["edit_ocr"](num_threads=1)
    names = list(candidates)
    scores = dict(zip(names, reward(np.stack([candidates[n] for n in names]), [EDIT.instruction] * len(names),
                                    sources=np.stack([source] * len(names)), targets=[EDIT.target] * len(names))))
    assert scores["correct"] > 0.95  # the OCR reads SYQJ and only the text region changed
    assert scores["correct"] - scores["wrong_word"] > 0.5
    assert scores["correct"] - scores["background_changed"] > 0.05
    assert scores["identity"] < 0.5  # nothing changed, but the sign still reads QNHIB
    assert max(scores, key=scores.get) == "correct"


def test_edit_ocr_consistency_weight_scales_the_penalty():
    source, edited = EDIT.images()
    changed = tinted(edited)[None]
    args = (changed, [EDIT.instruction])
    kwargs = dict(sources=source[None], targets=[EDIT.target])
    alone = EditOcrReward(consistency=0.0, num_threads=1)(*args, **kwargs)[0]
    one = EditOcrReward(consistency=1.0, num_threads=1)(*args, **kwargs)[0]
    two = EditOcrReward(consistency=2.0, num_threads=1)(*args, **kwargs)[0]
    assert alone == pytest.approx(1.0)
    assert alone - two == pytest.approx(2 * (alone - one), rel=1e-5) and one < alone


def test_text_region_and_outside_change():
    box = np.array([[10, 5], [20, 5], [20, 9], [10, 9]], np.float32)
    mask = text_region([box], (16, 32), margin=1)
    assert mask.sum() == (21 - 9 + 1) * (10 - 4 + 1) and mask[4, 9] and mask[10, 21] and not mask[3, 9]
    assert not text_region([], (16, 32), margin=1).any()
    a = np.zeros((16, 32, 3), np.uint8)
    b = a.copy()
    b[mask] = 255  # changes inside the region cost nothing
    assert outside_change(b, a, mask) == 0.0
    b[0, 0] = 51  # one pixel outside, all three channels: 0.2 over the outside pixels
    assert outside_change(b, a, mask) == pytest.approx(0.2 / (~mask).sum())
    assert outside_change(b, a, np.ones((16, 32), bool)) == 0.0


def test_conditioned_inputs_are_checked():
    images = np.zeros((2, 8, 8, 3), np.uint8)
    with pytest.raises(ValueError, match="sources must have the images' shape"):
        check_sources(images, np.zeros((2, 8, 4, 3), np.uint8), ["a", "b"])
    with pytest.raises(ValueError, match="uint8"):
        check_sources(images, images.astype(np.float32), ["a", "b"])
    with pytest.raises(ValueError, match="2 images but 1 targets"):
        check_sources(images, images, ["a"])
    check_sources(images, images, ["a", None])
    with pytest.raises(ValueError, match="edit_ocr needs each sample's target"):
        EditOcrReward(num_threads=1)(images, ["x", "y"], sources=images, targets=["a", None])
    with pytest.raises(ValueError, match="must be >= 0"):
        EditOcrReward(consistency=-1.0)
    assert EditOcrReward.conditioned


def test_vlm_edit_judge_sees_source_and_edit_side_by_side(fake_server):
    from jaxflow_bridge.rewards.vlm.vlm_edit_judge import BAR

    fake_server.reply = "8"
    url = f"http://127.0.0.1:{fake_server.server_address[1]}"
    judge = REGISTRY["vlm_edit_judge"](url, "fake-vl", backoff=0.01, timeout=5.0)
    source, edited = EDIT.images()
    scores = judge(edited[None], [EDIT.instruction], sources=source[None], targets=[None])
    np.testing.assert_allclose(scores, [0.8])
    (body,) = fake_server.posts
    image_part, text_part = body["messages"][1]["content"]
    assert EDIT.instruction in text_part["text"] and "left half" in text_part["text"]
    sent = np.asarray(Image.open(io.BytesIO(base64.b64decode(image_part["image_url"]["url"].split(",", 1)[1]))))
    w = source.shape[1]
    assert sent.shape == (source.shape[0], 2 * w + BAR, 3)
    assert np.array_equal(sent[:, :w], source) and np.array_equal(sent[:, w + BAR:], edited)
    assert body["temperature"] == 0.0
    with pytest.raises(ValueError, match="sources must have the images' shape"):
        judge(edited[None], [EDIT.instruction], sources=source[None, :, :8], targets=[None])


def test_a_source_shared_by_a_groups_samples_is_read_once(monkeypatch):
    """A group's 12 edits of one sign: 12 reads of the edits and one of the source, with the scores of a batch
    scored one sample at a time."""
    source, edited = EDIT.images()
    other = SignEdit("KFDM", "ABC", (0, 0))
    other_source, other_edited = other.images()
    images = np.stack([edited, tinted(edited)] * 6 + [other_edited])
    sources = np.stack([source] * 12 + [other_source])
    targets = [EDIT.target] * 12 + [other.target]
    reward = EditOcrReward(num_threads=1)
    one_at_a_time = [reward(images[i:i + 1], ["p"], sources=sources[i:i + 1], targets=targets[i:i + 1])[0]
                     for i in range(len(images))]
    reads = []
    read_lines = reward.ocr.read_lines
    monkeypatch.setattr(reward.ocr, "read_lines", lambda image: reads.append(image) or read_lines(image))
    scores = reward(images, ["p"] * len(images), sources=sources, targets=targets)
    np.testing.assert_array_equal(scores, np.asarray(one_at_a_time, np.float32))
    assert len(reads) == len(images) + 2
