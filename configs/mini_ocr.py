"""FlowGRPO with the OCR reward on the mini text-rendering Qwen-Image (issue 16), one GPU, about 10 minutes.

    python -m jaxflow.train --config configs/mini_ocr.py --config.model.path=OUT/pipeline
    python -m jaxflow.train --config configs/mini_ocr.py:control --config.model.path=OUT/pipeline

OUT/pipeline is built by scripts/mini_ocr.sh (which runs both). `:control` is the same run with the OCR scores
shuffled across the batch (`jaxflow/rewards/shuffled.py`): it must not raise OCR. Prompts: data/mini_ocr, written by
`python -m jaxflow.mini_ocr.words --out data/mini_ocr` (4000 train words, 200 held out for eval).
Both sides run float32 (the model is small); the diffusers engine runs in the trainer's process. Sizing (estimated,
not measured): OCR of the 192 images is the longest phase of a step (one RapidOCR engine, ~20 ms an image on a
16-core host), about 5 s a step with rollout and update, so 50 steps with 5 evals of 64 prompts fit 10 minutes.
"""
from pathlib import Path

from jaxflow.recipes import base, tiny

DATA = Path(__file__).resolve().parents[1] / "data" / "mini_ocr"
VARIANTS = ("", "control")


def get_config(variant: str = ""):
    if variant not in VARIANTS:
        raise ValueError(f"configs/mini_ocr.py:{variant}: unknown variant; use configs/mini_ocr.py or "
                         f"configs/mini_ocr.py:control")
    c = tiny(base())
    c.run_dir = "runs/mini_ocr_control" if variant else "runs/mini_ocr"
    c.model.path = ""  # the folder scripts/mini_ocr.sh builds: --config.model.path=OUT/pipeline
    c.lora.rank, c.lora.alpha = 32, 64.0
    c.rollout.update(device="cuda", num_gpus=1.0, in_process=True)
    c.sample.update(height=64, width=128, num_steps=10, guidance=4.0, noise_level=1.2, window_size=2,
                    window_range=(0, 5), max_sequence_length=32, prompts_per_step=16, group_size=12,
                    prompts_per_call=4)  # the OCR of a chunk overlaps the rollout of the next
    c.train.update(num_steps=50, learning_rate=3e-4, beta=0.0)
    c.reward.fns = {"ocr_shuffled": 1.0} if variant else {"ocr": 1.0}
    c.reward.workers = 4
    c.data = dict(train=str(DATA / "train.txt"), test=str(DATA / "test.txt"))
    c.eval.update(every=10, num_prompts=64, num_steps=10, guidance=4.0)
    c.checkpoint.update(every=10, keep=1)  # a run cut by a time limit resumes (scripts/mini_ocr.sh)
    return c
