"""The tiny default with a reward its random model can learn within minutes on a CPU: image brightness.

    python -m jaxflow.train --config configs/tiny_brightness.py

The tiny random Qwen-Image draws noise, so OCR scores it 0 everywhere (no signal to learn from); the mean pixel
value is a dense signal the LoRA moves from the first step. Group size, lr and steps: measured in README. The
evals also watch a gold reward that brightness ruins (`midtone`), the over-optimization demo.
"""
from jaxflow.config.recipes import base, tiny


def get_config():
    c = tiny(base())
    c.run_dir = "runs/tiny_brightness"
    c.reward.fns = {"brightness": 1.0}
    c.sample.group_size = 8  # 32 images a step: a steadier gradient than 16
    c.train.num_steps, c.train.learning_rate = 40, 1e-2
    c.eval.every = c.checkpoint.every = 40  # one eval grid and checkpoint, at the end
    # a gold reward that brightness ruins (closeness to mid-grey), lora_best kept by it; with
    # --config.eval.every=1 --config.eval.stop_after=2 --config.train.learning_rate=3e-2 the run stops once
    # brightness hacks it (docs/running.md)
    c.eval.rewards, c.eval.best_metric = {"midtone": 1.0}, "midtone"
    return c
