"""The real setting: Qwen-Image LoRA FlowGRPO on OCR prompts, vLLM-Omni rollout.

    python -m jaxflow.train --config configs/qwen_ocr.py --config.model.path=/models/Qwen-Image

Values and their sources:
- 512^2, 10 sampling steps, noise 1.2 'sde', window 2 in [0, 5), true CFG 4, 50 ODE eval steps:
  flow_grpo `config/grpo.py: pickscore_qwenimage` and verl-omni
  `examples/flowgrpo_trainer/qwen_image/run_qwen_image_ocr_lora.sh`.
- LoRA r64 / alpha128 on the 12 targets: flow_grpo `scripts/train_qwenimage.py`, verl-omni's OCR script.
- lr 3e-4, AdamW b (0.9, 0.999), wd 1e-4, eps 1e-8, grad clip 1.0, adv clip 5: flow_grpo `config/base.py`.
- clip range 1e-4: flow_grpo's default (verl-omni's script uses 1e-5); beta 0: both Qwen recipes.
- 32 prompts x 16 images per step: both (pickscore_qwenimage groups per epoch; verl-omni train_batch_size 32, n 16).
- 2 optimizer updates of 256 samples per step, like both: flow_grpo `scripts/train_qwenimage.py` with
  num_batches_per_epoch 4 and gradient_accumulation_steps 2 (2 updates per epoch), verl-omni's
  ppo_mini_batch_size 16 of train_batch_size 32 prompts. Here train.num_mini_batches 2: each update takes 16 whole
  prompt groups x 16 images (shuffled), in 32 micro-batches of 8 samples.
- old log-probs recomputed by the trainer before the first update (verl-omni's `compute_log_prob`; flow_grpo
  takes the rollout's): the bf16 rollout's log-probs differ from the trainer's by ~1e-4..4e-4
  (scripts/verify_logprob_parity.py on the tiny model), more than the 1e-4 clip band. The mismatch stays in the
  metrics (logp_diff_*).
- negative prompt " ": flow_grpo's Qwen pipeline. Reward: OCR (flow_grpo's `ocr`; verl-omni uses a VLM judge,
  available here as `vlm_ocr`).
"""
from pathlib import Path

from jaxflow.config import config_from_file


def get_config():
    c = config_from_file(Path(__file__).with_name("tiny_ocr.py"))
    c.run_dir = "runs/qwen_ocr"
    c.model.path = ""  # required: a diffusers Qwen-Image folder (model_index.json, transformer/, ...)
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "bfloat16"
    c.model.remat = "save_matmuls"
    c.lora.rank, c.lora.alpha = 64, 128.0
    c.rollout.engine = "vllm_omni"
    c.rollout.dtype = "bfloat16"
    c.rollout.device = "cuda"
    c.rollout.num_gpus = 1.0
    c.rollout.sleep_while_training = True
    s = c.sample
    s.height = s.width = 512
    s.num_steps, s.guidance, s.noise_level, s.sde_type = 10, 4.0, 1.2, "sde"
    s.window_size, s.window_range = 2, (0, 5)
    s.max_sequence_length = 128  # longest OCR prompt: 74 tokens; the train step pads every batch to this
    s.prompts_per_step, s.group_size, s.prompts_per_call = 32, 16, 4
    t = c.train
    t.num_steps, t.num_mini_batches, t.num_micro_batches = 300, 2, 32
    t.learning_rate, t.clip_range, t.beta = 3e-4, 1e-4, 0.0
    t.old_log_prob = "recompute"
    c.reward.fns = {"ocr": 1.0}
    c.reward.workers = 8
    c.eval.every, c.eval.num_prompts, c.eval.num_steps, c.eval.guidance = 30, 32, 50, 4.0
    c.checkpoint.every, c.checkpoint.keep = 10, 3
    return c
