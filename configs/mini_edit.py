"""FlowGRPO with the edit-OCR reward on the mini sign-editing Qwen-Image-Edit, one GPU, about 10 minutes.

    python -m jaxflow.train --config configs/mini_edit.py --config.model.path=OUT/pipeline \
        --config.data.train=OUT/data/train.jsonl --config.data.test=OUT/data/test.jsonl
    python -m jaxflow.train --config configs/mini_edit.py:control ...   # the shuffled-reward control
    python -m jaxflow.train --config configs/mini_edit.py:nft ...       # DiffusionNFT (and :nft_control)

OUT is built by experiments/mini_edit/run.sh (which runs both): a tiny Edit-shaped model pretrained to edit sign text
("Replace the word "A" with "B"", experiments/mini_edit/signs.py). `:control` is the same run with the edit-OCR scores
shuffled across the batch (`edit_ocr_shuffled`): it must not raise the held-out edit-OCR.

The RL recipe is configs/mini_ocr.py's (flow_grpo's SD3 OCR one: window 9 of 10 SDE steps at noise 0.7, two updates a
step, LoRA r32, EMA of the LoRA for the eval and export, a group's samples sharing their initial noise, 8.75 minutes
of steps) on the edit family, with 8 prompts a step where mini_ocr has 16 (an edit sample carries twice the image
tokens: the same train FLOPs a step, so about as many steps); the reward is edit_ocr with its consistency term
(weight 1: the change outside the text region costs), scored against each pair's source sign and target word.
"""
from pathlib import Path

from jaxflow.config.recipes import base, tiny

DATA = Path(__file__).resolve().parents[1] / "data" / "edit_signs"
VARIANTS = ("", "control", "nft", "nft_control")


def get_config(variant: str = ""):
    if variant not in VARIANTS:
        raise ValueError(f"configs/mini_edit.py:{variant}: unknown variant; choose one of {VARIANTS[1:]} or none")
    control, nft = variant.endswith("control"), variant.startswith("nft")
    c = tiny(base())
    c.run_dir = f"runs/mini_edit{'_nft' if nft else ''}{'_control' if control else ''}"
    c.model.family = "qwen_image_edit"
    c.model.path = ""  # the folder experiments/mini_edit/run.sh builds: --config.model.path=OUT/pipeline
    c.lora.rank, c.lora.alpha = 32, 64.0
    c.rollout.update(device="cuda", num_gpus=1.0, layout="in_process")
    c.model.matmul_precision = "default"
    # text padded to what the data holds: an instruction of two 5-letter words is 39 tokens after the template (no
    # instruction is longer), the negative " " 11; each plus the reference image's VL tokens (derived.text_tokens)
    # 8 prompts of 12 edits a step, half mini_ocr's 16: an edit row holds the target's 128 image tokens, the
    # reference's 128 and its text, so 96 edits a step cost the train step about the FLOPs of mini_ocr's 192
    # text-to-image samples (jaxflow_bench/flops.py: 1.01x), and the run as many steps in its 8.75 minutes
    c.sample.update(height=64, width=128, num_steps=10, guidance=4.0, noise_level=0.7, window_size=9,
                    window_range=(0, 9), max_sequence_length=40, negative_max_sequence_length=12,
                    prompts_per_step=8, group_size=12, prompts_per_call=8, same_latent=True)
    c.train.update(num_steps=1000, max_minutes=8.75, learning_rate=3e-4, beta=0.0, num_mini_batches=2,
                   old_log_prob="recompute", ema_decay=0.95)
    name = "edit_ocr_shuffled" if control else "edit_ocr"
    c.reward.fns = {name: 1.0}
    # 96 edits a step and their 8 source signs read by OCR (a group's source once): 12 engines of 1 thread each
    c.reward.update(workers=12, options={name: {"consistency": 1.0, "num_threads": 1}})
    c.data = dict(train=str(DATA / "train.jsonl"), test=str(DATA / "test.jsonl"))
    c.eval.update(every=10, num_prompts=64, num_steps=10, guidance=4.0)
    c.checkpoint.update(every=10, keep=1)  # a run cut by a time limit resumes (experiments/mini_edit/run.sh)
    if nft:  # configs/mini_ocr.py's nft arm: DiffusionNFT trains and samples CFG-free, a deterministic rollout
        c.train.algorithm = "nft"
        c.sample.update(guidance=1.0, sde_type="ode", same_latent=False)
        c.eval.guidance = 1.0
    return c
