"""The edit family's text padding holds the reference images' VL tokens (`spec.vision_tokens`, added by
`derived.text_tokens` through `Family.vision_tokens`), and the vllm_omni engine's sizes are checked at validation."""
import itertools

import numpy as np
import pytest
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from jaxflow.config import derived
from jaxflow.config.errors import UserError
from jaxflow.config.validation import config_module, validate
from jaxflow_bridge.families.qwen_image_edit import spec
from tests.helpers import ROOT

EDIT = ROOT / "configs" / "qwen_edit_ocr.py"


def test_vision_tokens_follow_qwen2_vls_resize():
    """At 512 x 512 an image is 18 x 18 merged tokens (324); every size and bound as transformers' smart_resize."""
    assert spec.vision_tokens(512, 512, 1) == 324 + spec.PICTURE_TOKENS
    assert spec.vision_tokens(512, 512, 2) == 2 * (324 + spec.PICTURE_TOKENS)
    for (h, w), bounds in itertools.product(itertools.product((28, 40, 64, 333, 512, 4096), (72, 128, 5000)),
                                            (spec.RELEASED_PIXELS, spec.TINY_PIXELS)):
        rh, rw = smart_resize(h, w, factor=spec.VISION_PATCH, min_pixels=bounds[0], max_pixels=bounds[1])
        assert spec.vision_tokens(h, w, 1, bounds) == (rh // 28) * (rw // 28) + spec.PICTURE_TOKENS, (h, w, bounds)


def test_the_edit_recipes_padding_holds_its_images():
    cfg = config_module(EDIT).get_config()
    assert derived.text_tokens(cfg) == (cfg.sample.max_sequence_length + 332,) * 2  # the 512 x 512 reference
    cfg.model.family = "qwen_image"
    assert derived.text_tokens(cfg) == (cfg.sample.max_sequence_length,) * 2  # text only


def test_the_tiny_edit_recipes_longest_prompt_fits_its_padding():
    """The tiny recipe at its size: a prompt at max_sequence_length (the longest the engine takes) encodes with its
    image to more tokens than that, and no more than the batch pads to."""
    from jaxflow_bridge.families.qwen_image_edit.diffusers_pipeline import RolloutPipeline, tiny_folder

    cfg = config_module(EDIT).get_config("tiny")
    s, limit = cfg.sample, cfg.sample.max_sequence_length
    pipe = RolloutPipeline.from_pretrained(tiny_folder(), "float32", "cpu")
    prompt = ""
    while len(pipe.tokenizer(pipe.template.format(prompt + " a"))["input_ids"]) - pipe.drop <= limit:
        prompt += " a"
    image = np.random.default_rng(0).integers(0, 256, (1, s.height, s.width, 3), dtype=np.uint8)
    (embeds,) = pipe.encode_with_images([prompt], [image])
    assert limit < len(embeds) <= derived.text_tokens(cfg)[0]


def test_an_edit_size_vllm_omni_would_change_is_refused_at_validation():
    cfg = config_module(EDIT).get_config("tiny")  # 40 x 72: the diffusers engine samples it
    validate(cfg)
    cfg.rollout.update(engine="vllm_omni", dtype="bfloat16", device="cuda")
    with pytest.raises(UserError, match=r"^config.sample.height: 40x72 .* use one of 32x64, 32x80, 48x64, 48x80$"):
        validate(cfg)
    cfg.sample.update(height=48, width=80)
    validate(cfg)
