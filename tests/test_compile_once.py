"""The train step compiles once: every batch reaches it with the same shapes, whatever its prompts' lengths."""
import jax
import numpy as np
import pytest

from jaxflow.driver import pad_text
from jaxflow.train import Trainer
from tests.helpers import tiny_config


def test_pad_text_gives_every_batch_one_shape():
    short, long = ({"prompt_embeds": np.ones((2, n, 4)), "prompt_mask": np.ones((2, n), bool),
                    "negative_prompt_embeds": np.ones((2, 6, 4)), "negative_prompt_mask": np.ones((2, 6), bool)}
                   for n in (40, 74))
    a, b = pad_text(short, 128), pad_text(long, 128)
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    assert a["prompt_mask"].sum() == 80 and a["prompt_embeds"].shape == (2, 128, 4)
    assert a["negative_prompt_embeds"].shape == (2, 128, 4)
    # negatives to their own length (sample.negative_max_sequence_length)
    c = pad_text(long, 128, 32)
    assert c["prompt_embeds"].shape == (2, 128, 4) and c["negative_prompt_embeds"].shape == (2, 32, 4)
    assert c["negative_prompt_mask"].shape == (2, 32) and c["negative_prompt_mask"].sum() == 12


def test_pad_text_names_the_key_of_a_too_long_text():
    batch = {"prompt_embeds": np.ones((1, 40, 4)), "prompt_mask": np.ones((1, 40), bool),
             "negative_prompt_embeds": np.ones((1, 9, 4)), "negative_prompt_mask": np.ones((1, 9), bool)}
    with pytest.raises(ValueError, match=r"negative_prompt_embeds has 9 tokens > "
                                         r"sample.negative_max_sequence_length=8: raise --config.sample.neg"):
        pad_text(batch, 64, 8)
    with pytest.raises(ValueError, match=r"prompt_embeds has 40 tokens > sample.max_sequence_length=32"):
        pad_text(batch, 32)


def test_train_step_compiles_once_over_steps(tmp_path):
    """Seed 0's steps 0 and 1 draw prompts of at most 64 and of more than 64 tokens (64-token buckets compiled the
    step twice); nothing compiles in step 1 (the LoRA export to the rollout compiled in step 0 too)."""
    cfg = tiny_config(tmp_path, num_steps=2)
    cfg.rollout.layout = "in_process"
    trainer = Trainer(cfg)
    compiles, counting = [], []

    def listen(event, secs, **kw):
        if counting and event == "/jax/core/compile/backend_compile_duration":
            compiles.append(secs)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        trainer.train_one(0)
        counting.append(True)
        trainer.train_one(1)
    finally:
        counting.clear()
        trainer.close()
    assert compiles == []
