"""The mini OCR proof's data: words, split, shipped prompt files, renders the OCR reward reads; the shuffled
control reward."""
import numpy as np

from experiments.mini_ocr.render import render, render_dataset
from experiments.mini_ocr.words import MAX_LEN, MIN_LEN, prompt, split, write_prompts
from jaxflow_bridge.rewards import build_reward
from jaxflow_bridge.rewards.ocr import OcrReward
from jaxflow_bridge.rewards.shuffled import Shuffled
from tests.helpers import ROOT


def test_split_is_deterministic_disjoint_and_matches_the_shipped_files(tmp_path):
    train, test = split(4000, 200)
    assert (train, test) == split(4000, 200) and not set(train) & set(test)
    assert all(MIN_LEN <= len(w) <= MAX_LEN and w.isalpha() and w.isupper() for w in train + test)
    write_prompts(tmp_path, 4000, 200)
    for name in ("train.txt", "test.txt"):
        assert (tmp_path / name).read_text() == (ROOT / "data" / "mini_ocr" / name).read_text()


def test_ocr_reads_clean_renders_and_not_blank_signs():
    """Clean renders of 12 held-out words score 1 (measured: 100 of 100); a blank sign scores 0."""
    words = split(4000, 200)[1][:12]
    images, index = render_dataset(words, 2)
    assert images.shape == (24, 64, 128, 3) and list(index[:4]) == [0, 0, 1, 1]
    assert not np.array_equal(images[0], images[1])  # variant 1 is shifted
    scores = OcrReward()(images[::2], [prompt(w) for w in words])
    assert scores.mean() >= 0.95, scores
    blank = np.full_like(images[:1], 255)
    assert OcrReward()(blank, [prompt(words[0])])[0] == 0.0
    np.testing.assert_array_equal(render(words[0]), images[0])


def test_shuffled_reward_permutes_scores_keeping_the_mean():
    inner = lambda images, prompts: np.arange(len(prompts), dtype=np.float32)  # noqa: E731
    fn = Shuffled(inner, seed=0)
    images, prompts = np.zeros((16, 2, 2, 3), np.uint8), ["x"] * 16
    a, b = fn(images, prompts), fn(images, prompts)
    assert sorted(a) == list(range(16)) and not np.array_equal(a, np.arange(16)) and not np.array_equal(a, b)
    np.testing.assert_array_equal(Shuffled(inner, seed=0)(images, prompts), a)  # seeded
    reward = build_reward({"ocr_shuffled": 1.0}, ocr_shuffled={"seed": 3})
    assert isinstance(reward.rewards["ocr_shuffled"], Shuffled)
