#!/usr/bin/env bash
# BAGEL-7B-MoT's recipe end to end on one GPU with random full-size weights: writes the folder if missing
# (scripts/make_random_bagel.py; MODEL_DIR, default /tmp/bagel_random, 29.4 GB), runs configs/bagel_ocr.py with
# vLLM-Omni serving the rollout in bf16 beside the trainer (JAX's fixed pool XLA_CLIENT_MEM_FRACTION, default 0.5),
# the recipe's sampling (512^2, 14 steps, window 2, CFG 4) and LoRA, PROMPTS prompts a step (default 2, one a rollout
# call), MICRO samples a micro-batch (default 2), STEPS steps (default 4), no eval or checkpoints; then prints the
# phase breakdown and writes OUT_DIR/RESULT.json (default e2e_bagel_1gpu; the GPU's peak memory by nvidia-smi).
# Random weights score OCR 0 (every advantage 0, the LoRA never moves): REWARD=brightness trains on mean brightness.
#
#   [MODEL_DIR=dir] [PROMPTS=2] [MICRO=2] [STEPS=4] [REWARD=ocr|brightness] [RESULT=name] \
#     bash scripts/bench_e2e_bagel.sh OUT_DIR [extra --config overrides]
set -euo pipefail
out=${1:?usage: bench_e2e_bagel.sh OUT_DIR [overrides]}; shift
model=${MODEL_DIR:-/tmp/bagel_random} prompts=${PROMPTS:-2} micro=${MICRO:-2} steps=${STEPS:-4}
reward=${REWARD:-ocr} result=${RESULT:-e2e_bagel_1gpu}
read -r mini group <<<"$(python3 -c "
import importlib.util as u; s = u.spec_from_file_location('r', 'configs/bagel_ocr.py'); m = u.module_from_spec(s)
s.loader.exec_module(m); c = m.get_config(); print(c.train.num_mini_batches, c.sample.group_size)")"
mkdir -p "$out"
# jax >= 0.11 ignores the GPU if the deprecated XLA_PYTHON_CLIENT_MEM_FRACTION is set beside XLA_CLIENT_MEM_FRACTION
unset XLA_PYTHON_CLIENT_MEM_FRACTION
export XLA_CLIENT_MEM_FRACTION=${XLA_CLIENT_MEM_FRACTION:-0.5} XLA_PYTHON_CLIENT_PREALLOCATE=true PYTHONUNBUFFERED=1
python3 -c "import jax; b = jax.default_backend(); assert b == 'gpu', f'JAX runs on {b}, not the GPU'; print(jax.devices())"
[ -f "$model/ema.safetensors" ] || python3 scripts/make_random_bagel.py --out "$model"
reward_fns=()
[ "$reward" = ocr ] || reward_fns=(--config.reward.fns="{\"$reward\": 1.0}")
cmd=(python3 -m jaxflow.train --config configs/bagel_ocr.py --config.model.path="$model"
  --config.rollout.engine=vllm_omni --config.rollout.dtype=bfloat16 --config.rollout.device=cuda
  --config.rollout.num_gpus=1 --config.sample.prompts_per_step="$prompts" --config.sample.prompts_per_call=1
  --config.train.num_micro_batches=$((prompts * group / mini / micro)) --config.train.num_steps="$steps"
  --config.eval.every=0 --config.checkpoint.every=1000 --config.log.progress=False --config.run_dir="$out/run"
  "${reward_fns[@]}" "$@")
nvidia-smi ${CUDA_VISIBLE_DEVICES:+-i "$CUDA_VISIBLE_DEVICES"} --query-gpu=memory.used --format=csv,noheader,nounits \
  -lms 500 >"$out/gpu_mem.csv" 2>/dev/null &
smi=$!
"${cmd[@]}" 2>&1 | while IFS= read -r line; do printf '%(%H:%M:%S)T %s\n' -1 "$line"; done | tee "$out/train.log"
kill "$smi" 2>/dev/null || true
python3 -m jaxflow_bench.summary "$out/run" --gpus 1 --result "$result" --out "$out" --gpu-mem "$out/gpu_mem.csv" \
  --command "XLA_CLIENT_MEM_FRACTION=$XLA_CLIENT_MEM_FRACTION PROMPTS=$prompts MICRO=$micro STEPS=$steps \
REWARD=$reward bash scripts/bench_e2e_bagel.sh OUT $*"
