"""configs/qwen_edit_ocr.py: the published edit recipe's values, and its tiny variant through the validation stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxflow.config.validation import UserError, config_module, validate

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "qwen_edit_ocr.py"


def test_edit_recipe_at_the_published_settings():
    c = config_module(RECIPE).get_config()
    assert c.model.family == "qwen_image_edit"
    assert (c.sample.height, c.sample.width, c.sample.num_steps, c.sample.guidance) == (512, 512, 10, 4.0)
    assert (c.sample.noise_level, c.sample.window_size, tuple(c.sample.window_range)) == (1.5, 4, (0, 5))
    assert (c.sample.prompts_per_step, c.sample.group_size, c.train.num_mini_batches) == (32, 16, 2)
    assert (c.train.learning_rate, c.train.clip_range, c.train.beta, c.train.ema_decay) == (3e-4, 1e-4, 0.0, 0.0)
    assert dict(c.reward.fns) == {"edit_ocr": 1.0} and set(c.reward.options) == {"edit_ocr"}
    assert c.data.train.endswith("data/edit_signs/train.jsonl") and Path(c.data.train).is_file()


def test_tiny_edit_recipe_passes_the_validation_stage():
    c = config_module(RECIPE).get_config("tiny")
    assert (c.model.family, c.model.path, c.rollout.device) == ("qwen_image_edit", "tiny_edit", "cpu")
    assert c.data.train.endswith("data/edit_signs/train.jsonl")
    validate(c)


@pytest.mark.parametrize("key", ["train", "test"])
def test_conditioned_reward_needs_an_edit_dataset(key):
    """edit_ocr scores an edit against its source image: plain prompt files fail the validation stage by name."""
    c = config_module(RECIPE).get_config("tiny")
    c.data[key] = str(RECIPE.parents[1] / "data" / "ocr" / f"{key}.txt")
    with pytest.raises(UserError, match=rf"data\.{key}: .* no source image, but reward\(s\) \['edit_ocr'\]"):
        validate(c)


def test_edit_ocr_needs_each_rows_target(tmp_path):
    c = config_module(RECIPE).get_config("tiny")
    rows = (RECIPE.parents[1] / "data" / "edit_signs" / "test.jsonl").read_text().splitlines()
    row = json.loads(rows[0])
    row["image"] = str(RECIPE.parents[1] / "data" / "edit_signs" / row.pop("image"))
    del row["target"]
    (tmp_path / "test.jsonl").write_text(json.dumps(row) + "\n")
    c.data.test = str(tmp_path / "test.jsonl")
    with pytest.raises(UserError, match=r"data\.test: .* has no \"target\""):
        validate(c)
