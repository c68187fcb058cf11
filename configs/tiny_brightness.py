"""The tiny default with a reward its random model can learn within minutes on a CPU: image brightness.

    python -m jaxflow.train --config configs/tiny_brightness.py

The tiny random Qwen-Image draws noise, so OCR scores it 0 everywhere (no signal to learn from); the mean pixel
value is a dense signal the LoRA moves from the first step. Group size, lr and steps: measured in README.
"""
from jaxflow.config.recipes import base, tiny


def get_config():
    c = tiny(base())
    c.run_dir = "runs/tiny_brightness"
    c.reward.fns = {"brightness": 1.0}
    c.sample.group_size = 8  # 32 images a step: a steadier gradient than 16
    c.train.num_steps, c.train.learning_rate = 40, 1e-2
    c.eval.every = c.checkpoint.every = 40  # one eval grid and checkpoint, at the end
    return c
