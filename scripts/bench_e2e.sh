#!/usr/bin/env bash
# End-to-end `python -m jaxflow.train` at Qwen-Image size with random weights on one GPU (gpu-bench row 4):
# writes a full-size pipeline folder without transformer weights (model.init=random: the trainer and the rollout
# draw the same 20B weights on the GPU), runs the qwen_ocr settings (512^2, 10 steps, window 2, CFG 4, LoRA r64)
# with the diffusers engine in the trainer's process, then prints img/GPU/s and the phase breakdown.
# JAX holds a fixed half of the GPU, torch the rest, so the rollout need not sleep while the trainer runs.
#   bash scripts/bench_e2e.sh OUT_DIR [extra --config overrides]
set -euo pipefail
out=${1:?usage: bench_e2e.sh OUT_DIR [overrides]}; shift
mkdir -p "$out"   # the whole training log goes to $out/train.log (keep it: a run cut off by a time limit leaves it)
model=${MODEL_DIR:-/tmp/qwen_random}
# One process holds JAX and torch: give JAX a fixed pool (its allocator never returns memory to torch).
# (jax >= 0.11 reads XLA_CLIENT_MEM_FRACTION and refuses the GPU if the old XLA_PYTHON_CLIENT_MEM_FRACTION is also set)
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-true} XLA_CLIENT_MEM_FRACTION=${XLA_CLIENT_MEM_FRACTION:-0.5}
unset XLA_PYTHON_CLIENT_MEM_FRACTION
export PYTHONUNBUFFERED=1
python3 -c "import jax; b = jax.default_backend(); assert b == 'gpu', f'JAX runs on {b}, not the GPU'; print(jax.devices())"
[ -f "$model/model_index.json" ] || python3 scripts/make_random_pipeline.py --out "$model" --no-transformer-weights
python3 -m jaxflow.train --config configs/qwen_ocr.py --config.model.path="$model" --config.model.init=random \
  --config.rollout.engine=diffusers --config.rollout.in_process=True --config.rollout.device=cuda \
  --config.rollout.sleep_while_training=False \
  --config.rollout.num_gpus=0 --config.sample.prompts_per_step=2 --config.sample.prompts_per_call=1 \
  --config.train.num_micro_batches=8 --config.train.num_steps=4 --config.train.text_bucket=128 --config.eval.every=1000 \
  --config.checkpoint.every=1000 --config.log.progress=False --config.run_dir="$out/run" \
  --config.reward.fns="{'jpeg_incompressibility': 1.0}" "$@" 2>&1 | tee "$out/train.log"
python3 scripts/summarize_run.py "$out/run"
