"""Qwen-Image-Edit LoRA FlowGRPO on sign edits ("Replace the word "A" with "B""), scored by edit-OCR: the recipe of
configs/qwen_ocr.py with the edit model, the edit data and reward (each key's meaning: jaxflow/config/recipes.py's
HELP).

    python -m jaxflow.train --config configs/qwen_edit_ocr.py --config.model.path=/models/Qwen-Image-Edit
    python -m jaxflow.train --config configs/qwen_edit_ocr.py:tiny   # toy size on the CPU (the tests' edit config)

`:tiny` is the recipe with jaxflow/config/recipes.py's tiny overrides on the tiny offline edit model ("tiny_edit",
diffusers on the CPU; tests/run/test_edit_run.py trains it through Ray); a tiny random model's edits read as nothing,
so its reward moves only through the consistency term.

Data: the edit JSONL format, one {"image": path relative to the .jsonl, "instruction", "target"} a line
(experiments/mini_edit/signs.py). The shipped set, data/edit_signs (64 train and 16 held-out 64x128 signs, the
sources resized to the output size), is enough to start; a full-size set is one command:
`python -m experiments.mini_edit.signs --out data/edit_signs_512 --train 4000 --test 200 --height 512 --width 512`
then --config.data.train=data/edit_signs_512/train.jsonl --config.data.test=data/edit_signs_512/test.jsonl.

Values and their sources (flow_grpo `config/grpo.py: counting_qwenimage_edit_fast`, its Qwen-Image-Edit recipe, over
`config/base.py`; verl-omni publishes no Qwen-Image-Edit recipe in `examples/flowgrpo_trainer/`, so its Qwen-Image OCR
script `run_qwen_image_ocr_lora.sh`, which base() already follows, stands for it):
- 512^2, 10 sampling steps, true CFG 4, 50 eval steps: counting_qwenimage_edit(_fast).
- noise 1.5 'sde' in a window of 4 steps in [0, 5): counting_qwenimage_edit_fast (the non-fast entry: noise 1.0
  on every step, no window).
- 32 prompts x 16 images a step, 2 optimizer updates a step: counting_qwenimage_edit(_fast) (32 GPUs x 4 images x
  4 batches a epoch = 512 images, 16 per prompt; gradient_accumulation_steps = num_batches_per_epoch / 2).
- lr 3e-4, clip range 1e-4, adv clip 5, grad clip 1.0, AdamW (0.9, 0.999), wd 1e-4: flow_grpo `config/base.py`
  (the edit entries keep them); beta (KL) 0 and no EMA: counting_qwenimage_edit(_fast).
- LoRA r64 / alpha128 on the 12 attention and MLP targets, the old log-probs recomputed, global std: base()'s
  (configs/qwen_ocr.py says where each comes from); the edit transformer has Qwen-Image's blocks.
- reward: edit_ocr, weight 1, its consistency term weight 1 (rewards/edit_ocr.py). flow_grpo's edit recipe pairs its
  task reward (GenEval counting, 0.8) with an image-similarity term (0.2) for the same purpose: keep what the
  instruction does not touch.
"""
from pathlib import Path

from jaxflow.config.recipes import base, tiny

DATA = Path(__file__).resolve().parents[1] / "data" / "edit_signs"


def get_config(variant: str = ""):
    if variant not in ("", "tiny"):
        raise ValueError(f"configs/qwen_edit_ocr.py:{variant}: unknown variant; choose tiny or none")
    c = base()
    c.run_dir = "runs/qwen_edit_ocr"
    c.model.family = "qwen_image_edit"
    c.sample.update(height=512, width=512, num_steps=10, guidance=4.0, noise_level=1.5, sde_type="sde",
                    window_size=4, window_range=(0, 5), prompts_per_step=32, group_size=16)
    c.train.update(learning_rate=3e-4, clip_range=1e-4, adv_clip=5.0, max_grad_norm=1.0, beta=0.0, ema_decay=0.0,
                   num_mini_batches=2)
    c.reward.fns = {"edit_ocr": 1.0}
    c.reward.options = {"edit_ocr": {"consistency": 1.0, "num_threads": 2}}
    c.eval.update(num_steps=50, guidance=4.0)
    c.data = dict(train=str(DATA / "train.jsonl"), test=str(DATA / "test.jsonl"))
    if variant == "tiny":
        c = tiny(c)
        c.model.path = "tiny_edit"  # the family's tiny offline model (jaxflow_bridge/families/qwen_image_edit/tiny.py)
        c.run_dir = "runs/tiny_edit_ocr"
        c.sample.window_size = 2  # of tiny's 4 steps, in its window_range (0, 3)
        c.reward.options = {"edit_ocr": {"consistency": 1.0, "num_threads": 1}}
    return c
