"""The real setting: Qwen-Image LoRA FlowGRPO on OCR prompts, vLLM-Omni rollout: jaxflow/config/recipes.py's base
(each key's meaning: its HELP).

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
  prompt groups x 16 images (shuffled), in 64 micro-batches of 4 samples: the largest micro-batch whose step fits
  one H200 beside the vLLM-Omni engine (JAX's pool 0.56 of the GPU, the engine the rest for the weights and the 7B
  text encoder), and faster than 2, measured (`scripts/fit_micro_batch.py`; what each size needs and its speed:
  BENCHMARKS.md, "Memory fit: which micro-batch fits"). On more devices a micro-batch spreads over them
  (train.num_micro_batches counts the micro-batches of one update).
- old log-probs recomputed by the trainer before the first update (verl-omni's `compute_log_prob`; flow_grpo
  takes the rollout's): the bf16 rollout's log-probs differ from the trainer's by ~1e-4..4e-4
  (scripts/verify_logprob_parity.py), more than the 1e-4 clip band. The mismatch stays in the metrics
  (logp_diff_*).
- negative prompt " ": flow_grpo's Qwen pipeline. Reward: OCR (flow_grpo's `ocr`; verl-omni uses a VLM judge,
  available here as `vlm_ocr`).
"""
from jaxflow.config.recipes import base


def get_config():
    return base()
