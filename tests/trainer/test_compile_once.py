"""The train step compiles once: every batch reaches it with the same shapes, whatever its prompts' lengths."""
import jax
import pytest

from jaxflow.run.driver import text_length_error
from jaxflow.train import Trainer
from jaxflow_bridge.contract.trajectory import TextLengthError
from tests.helpers import tiny_config


def test_text_length_error_names_the_knob_to_raise(tmp_path):
    """The rollout's text longer than the train batch's padding (`config.text_tokens`, what the rollout client
    pads to): one line naming the sample key to raise."""
    cfg = tiny_config(tmp_path)
    cfg.sample.max_sequence_length, cfg.sample.negative_max_sequence_length = 64, 8
    err = text_length_error(TextLengthError("negative_prompt_embeds", 9, 8), cfg)
    assert str(err) == ("negative_prompt_embeds has 9 tokens > sample.negative_max_sequence_length=8: raise "
                        "--config.sample.negative_max_sequence_length (or shorten the prompt)")
    err = text_length_error(TextLengthError("prompt_embeds", 70, 64), cfg)
    assert "sample.max_sequence_length=64: raise --config.sample.max_sequence_length" in str(err)
    cfg.sample.negative_max_sequence_length = 0  # negatives padded as the prompts
    negative = text_length_error(TextLengthError("negative_prompt_embeds", 70, 64), cfg)
    assert "--config.sample.max_sequence_length " in str(negative)


@pytest.mark.slow
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
