"""A folder's image processor bounds (`spec.pixel_bounds`): the keys transformers < 5 and the released folders write,
the `size` that transformers >= 5 saves, the released bounds where the folder says nothing; the trainer's padding of
the VL prompt (`Family.vision_tokens`) follows the folder's."""
import json

import pytest

from jaxflow import families
from jaxflow_bridge.families.qwen_image_edit import spec
from tests.helpers import tiny_config


@pytest.mark.parametrize("name, config, want", [
    ("processor", {"min_pixels": 3136, "max_pixels": 12845056}, (3136, 12845056)),
    ("image_processor", {"size": {"shortest_edge": 784, "longest_edge": 3136}}, (784, 3136)),
    ("processor", {}, spec.RELEASED_PIXELS),
])
def test_pixel_bounds_of_a_folder(tmp_path, name, config, want):
    (tmp_path / name).mkdir()
    (tmp_path / name / "preprocessor_config.json").write_text(json.dumps(config))
    assert spec.pixel_bounds(tmp_path) == want


def test_no_processor_means_the_released_bounds(tmp_path):
    assert spec.pixel_bounds(tmp_path / "absent") == spec.RELEASED_PIXELS


def test_vision_tokens_follow_the_folders_bounds(tmp_path):
    cfg = tiny_config(tmp_path)
    cfg.sample.update(height=64, width=128)
    family = families.by_name("qwen_image_edit")
    (tmp_path / "image_processor").mkdir()
    (tmp_path / "image_processor" / "preprocessor_config.json").write_text(
        json.dumps({"size": {"shortest_edge": spec.TINY_PIXELS[0], "longest_edge": spec.TINY_PIXELS[1]}}))
    cfg.model.path = str(tmp_path)
    tiny = family.vision_tokens(cfg)
    cfg.model.path = str(tmp_path / "absent")
    assert tiny == spec.vision_tokens(64, 128, 1, spec.TINY_PIXELS) < family.vision_tokens(cfg)
