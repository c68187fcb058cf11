"""configs/mini_edit.py pads text to what the sign-edit data holds: its longest instruction fits the rollout's
max_sequence_length, and with the reference image's VL tokens the train batch's padding, which stays near it."""

from __future__ import annotations

import numpy as np

from experiments.mini_edit.signs import INSTRUCTION, split_edits
from experiments.mini_ocr.words import LETTERS, MAX_LEN
from jaxflow.config import derived
from jaxflow.config.validation import config_module
from tests.helpers import ROOT


def test_the_mini_edit_text_padding_holds_the_longest_instruction_and_little_more():
    # the mini pipeline's VL tokenizer and image processor are the tiny edit folder's (experiments/mini_edit/prepare.py)
    from jaxflow_bridge.families.qwen_image_edit.diffusers_pipeline import RolloutPipeline, tiny_folder

    cfg = config_module(ROOT / "configs" / "mini_edit.py").get_config()
    cfg.model.path = str(tiny_folder())  # run.sh's OUT/pipeline holds the tiny folder's image processor
    s, (prompt_tokens, negative_tokens) = cfg.sample, derived.text_tokens(cfg)
    pipe = RolloutPipeline.from_pretrained(tiny_folder(), "float32", "cpu")
    train, test = split_edits(4000, 200)
    longest = INSTRUCTION.format(LETTERS[0] * MAX_LEN, LETTERS[-1] * MAX_LEN)
    texts = [e.instruction for e in train + test] + [longest]
    ids = pipe.tokenizer([pipe.template.format(t) for t in texts + [" "]])["input_ids"]
    lengths = [len(x) - pipe.drop for x in ids]
    assert max(lengths[:-1]) == lengths[-2] <= s.max_sequence_length  # the rollout refuses longer prompts
    assert lengths[-1] <= s.negative_max_sequence_length
    source = np.full((1, s.height, s.width, 3), 255, np.uint8)
    prompt, negative = pipe.encode_with_images([longest, " "], [source, source])
    assert len(prompt) <= prompt_tokens <= len(prompt) + 16  # the trajectory pads to these (no more than it needs)
    assert len(negative) <= negative_tokens <= len(negative) + 16


def test_every_mini_edit_variant_validates_and_the_nft_arm_trains_cfg_free():
    """run.sh's ARM=nft runs configs/mini_edit.py:nft and :nft_control: DiffusionNFT with a CFG-free, deterministic
    rollout and eval (as configs/mini_ocr.py's nft arm); the controls train on the shuffled reward."""
    from jaxflow.config.validation import validate
    from jaxflow_bridge.families.qwen_image_edit.diffusers_pipeline import tiny_folder

    module = config_module(ROOT / "configs" / "mini_edit.py")
    seen = {}
    for variant in module.VARIANTS:
        cfg = module.get_config(variant)
        cfg.model.path = str(tiny_folder())
        validate(cfg)
        seen[variant] = (cfg.train.algorithm, cfg.sample.guidance, cfg.sample.sde_type, cfg.eval.guidance,
                         list(cfg.reward.fns))
    assert seen[""] == ("flowgrpo", 4.0, "sde", 4.0, ["edit_ocr"])
    assert seen["nft"] == ("nft", 1.0, "ode", 1.0, ["edit_ocr"])
    assert seen["control"][-1] == seen["nft_control"][-1] == ["edit_ocr_shuffled"]
    assert seen["nft_control"][:-1] == seen["nft"][:-1]
