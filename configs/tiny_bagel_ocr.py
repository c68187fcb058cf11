"""The BAGEL recipe (configs/bagel_ocr.py) on the tiny random BAGEL (jaxflow_bridge/families/bagel/tiny.py),
float32 on the CPU, in a few minutes:

    python -m jaxflow.train --config configs/tiny_bagel_ocr.py [--config.train.num_steps=4]

The same knobs at toy sizes (jaxflow/config/recipes.py `tiny`): 64 x 96 images (4 x 6 latent tokens), 4 steps, a window of 2
in [0, 3), 2 prompts x 4 images, the rollout's log-probs as the old ones. The random model draws noise, so OCR scores
0 everywhere: this run checks the plumbing (rollout, LoRA sync, train step, eval, export), not learning.
"""
from pathlib import Path

from jaxflow.config.recipes import tiny

BAGEL = Path(__file__).resolve().parent / "bagel_ocr.py"


def get_config():
    from jaxflow.config.validation import config_module
    c = tiny(config_module(BAGEL).get_config())
    c.run_dir = "runs/tiny_bagel_ocr"
    c.model.path = "tiny_bagel"
    c.rollout.update(engine="bagel_torch")
    c.sample.update(height=64, width=96, prompts_per_step=2, group_size=4, prompts_per_call=1,
                    max_sequence_length=128)
    c.eval.update(num_prompts=2)
    return c
