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
