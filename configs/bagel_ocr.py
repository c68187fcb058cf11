"""BAGEL-7B-MoT LoRA FlowGRPO on OCR prompts (docs/bagel.md §7 (e)): the values of verl-omni's BAGEL OCR recipe
(`examples/flowgrpo_trainer/run_bagel_ocr_lora.sh`, its `common.py` from flow_grpo's BAGEL trainer).

    python -m jaxflow.train --config configs/bagel_ocr.py --config.model.path=/models/BAGEL-7B-MoT

Sampling: 512^2, 14 steps (the script's num_inference_steps=15 schedule points), 'sde' noise 0.7, a window of 2 in
steps [0, 7), static shift 3.0 (BAGEL's, in the engine); text CFG 4.0 over the whole interval with per-sample global
renorm (min 0), the empty context as the unconditional branch. LoRA r64 / alpha 128 on the generation expert's seven
projections; lr 1e-4, weight decay 1e-4, clip range 1e-5, 32 prompts x 16 images, two mini-batches, advantages
normalised per group (global_std False), beta 0, old log-probs recomputed; prompts up to 256 tokens; eval 50 ODE
steps. The rollout is vLLM-Omni's single-stage BAGEL in bf16 (our pipeline, docs/bagel.md §3), as for Qwen-Image.
One H200 holds it at 2 samples a micro-batch with JAX's pool at half the GPU (`XLA_PYTHON_CLIENT_PREALLOCATE=true
XLA_CLIENT_MEM_FRACTION=0.5`; the update's plan and the GPU's peak, measured at 2 prompts a step and one a rollout
call: BENCHMARKS.md and benchmarks/HISTORY.md, BAGEL-7B-MoT at full size). On the CPU: configs/tiny_bagel_ocr.py
(the `bagel_torch` engine).
"""
from jaxflow.config.recipes import base
from jaxflow_bridge.families.bagel.keymap import DEFAULT_LORA_TARGETS


def get_config():
    c = base()
    c.run_dir = "runs/bagel_ocr"
    c.model.update(family="bagel", scan_unroll=1, remat="save_matmuls")
    c.lora.update(rank=64, alpha=128.0, targets=list(DEFAULT_LORA_TARGETS))
    c.sample.update(height=512, width=512, num_steps=14, guidance=4.0, noise_level=0.7, sde_type="sde",
                    window_size=2, window_range=(0, 7), cfg_interval=(0.0, 1.0), cfg_renorm_min=0.0, negative_prompt="",
                    max_sequence_length=256, prompts_per_step=32, group_size=16, prompts_per_call=4)
    c.train.update(learning_rate=1e-4, weight_decay=1e-4, clip_range=1e-5, global_std=False, beta=0.0,
                   num_mini_batches=2, num_micro_batches=128, xla_options={})
    c.eval.update(num_steps=50, guidance=4.0)
    return c
