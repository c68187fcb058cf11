"""The embedded default: the tiny offline Qwen-Image, diffusers rollout on CPU, a few minutes on 2 cores.

    python -m jaxflow.train --config configs/tiny_ocr.py [--config.train.num_steps=20]

The same knobs as configs/qwen_ocr.py (which derives from this file) at toy sizes. The tiny VAE has spatial
factor 4, so 40x72 images are 5x9 packed latent tokens.
"""
from pathlib import Path

import ml_collections

from jaxflow.models.keymap import DEFAULT_LORA_TARGETS

DATA = Path(__file__).resolve().parents[1] / "data" / "ocr"  # found from any working directory


def get_config():
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.run_dir = "runs/tiny_ocr"
    c.model = dict(path="tiny", dtype="float32", param_dtype="float32", remat="none", attention="auto",
                   matmul_precision="auto",  # "highest" for float32 compute (true fp32 on GPUs, not TF32)
                   init="checkpoint")  # "random": base weights drawn from `seed` (bridge/random_weights.py)
    c.lora = dict(rank=8, alpha=16.0, targets=list(DEFAULT_LORA_TARGETS))
    c.rollout = dict(engine="diffusers", dtype="float32", device="cpu", num_servers=1, num_gpus=0.0,
                     num_cpus=1.0, sleep_while_training=False, max_retries=2, address="",
                     in_process=False,  # True: the engine runs in the trainer's process (no Ray)
                     compile=False)  # diffusers engine: torch.compile the transformer block
    c.sample = dict(height=40, width=72, num_steps=4, guidance=4.0, noise_level=1.2, sde_type="sde",
                    window_size=2, window_range=(0, 3), negative_prompt=" ",
                    max_sequence_length=128,  # the longest OCR prompt has 74; the train step pads text to this
                    prompts_per_step=4, group_size=4, prompts_per_call=2)
    c.train = dict(num_steps=10, num_micro_batches=1, learning_rate=3e-4, clip_range=1e-4, adv_clip=5.0,
                   beta=0.0, global_std=True, max_grad_norm=1.0, weight_decay=1e-4, ema_decay=0.0,
                   old_log_prob="rollout",
                   num_mini_batches=1,  # optimizer updates per step, each on whole prompt groups
                   num_inner_epochs=1)  # passes over the step's mini-batches
    c.reward = dict(fns={"ocr": 1.0}, options={}, workers=2)
    c.data = dict(train=str(DATA / "train.txt"), test=str(DATA / "test.txt"))
    c.eval = dict(every=5, num_prompts=4, num_steps=4, guidance=4.0)
    c.checkpoint = dict(every=5, keep=3)
    c.sharding = dict(data=-1, fsdp=1, tensor=1, rules=[("batch", ("data", "fsdp"))])
    c.log = dict(tensorboard=True, progress=True)
    # jax.profiler trace of steps start_step .. start_step + num_steps - 1 (0 steps: off); dir "" = run_dir/profile
    c.profile = dict(start_step=2, num_steps=0, dir="")
    return c
