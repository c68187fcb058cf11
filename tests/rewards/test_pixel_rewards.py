"""Pixel-statistic rewards: values, range and registry."""
import numpy as np
import pytest

from jaxflow_bridge.rewards import build_reward
from jaxflow_bridge.rewards.pixel import brightness


def test_brightness_is_the_mean_pixel_value_scaled_to_one():
    images = np.zeros((3, 4, 5, 3), np.uint8)
    images[1] = 255
    images[2, :2] = 255  # top half of 4 rows white
    np.testing.assert_allclose(brightness(images, ["a", "b", "c"]), [0.0, 1.0, 0.5], atol=1e-7)
    out = build_reward({"brightness": 1.0})(images, ["a", "b", "c"])
    assert out["avg"].dtype == np.float32 and out["avg"].shape == (3,)
    with pytest.raises(ValueError, match="prompts"):
        brightness(images, ["a"])


def test_midtone_scores_mid_grey_one_and_black_or_white_zero():
    images = np.zeros((5, 4, 5, 3), np.uint8)
    images[1] = 255
    images[2, :2] = 255  # half white, half black: bright 0.5, yet no midtone at all
    images[3] = 128  # ~mid-grey
    images[4] = 191  # half way from mid-grey to white
    from jaxflow_bridge.rewards.pixel import midtone
    got = midtone(images, list("abcde"))
    np.testing.assert_allclose(got, [0.0, 0.0, 0.0, 1 - 0.5 / 127.5, 1 - 63.5 / 127.5], atol=1e-6)
    assert got.dtype == np.float32
    brighter = np.full((2, 4, 5, 3), 128, np.uint8)
    brighter[1] = 230  # brightness rises, the gold falls
    assert brightness(brighter, "ab")[1] > brightness(brighter, "ab")[0]
    assert midtone(brighter, "ab")[1] < midtone(brighter, "ab")[0]
    out = build_reward({"midtone": 1.0})(images, list("abcde"))
    np.testing.assert_allclose(out["midtone"], got)
