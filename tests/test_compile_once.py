"""The train step compiles once: every batch reaches it with the same shapes, whatever its prompts' lengths."""
import jax
import numpy as np

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
