#!/usr/bin/env bash
# The recipe at its real batch on every GPU of one node, launched as users launch it on a cluster: a one-node Ray
# cluster (`ray start --head`) and launch/ray_train.sh. configs/qwen_ocr.py as it is (32 prompts x 16 images = 512
# images a step, 4 prompts a rollout request, 2 updates a step, CFG 4, LoRA r64, the OCR reward) with random
# full-size weights (bench_e2e.sh's folder), the colocated layout: the trainer data-parallel over all GPUs in a fixed
# JAX pool on each, one vLLM-Omni engine on each GPU; STEPS steps (3: the first compiles), no eval or checkpoints.
# Then OUT_DIR/e2e_8gpu.json (jaxflow_bench.summary's figures: img_per_gpu_s, gpus, step and phase seconds, sync_s the LoRA
# sync to every engine, bound_modules the count every engine acknowledged, the same on all; with ONE_GPU, a
# bench_e2e.sh one-GPU result of this host, scaling_efficiency: img/GPU/s over that run's img/GPU/s).
#
#   [MICRO=2] [STEPS=3] [ONE_GPU=DIR/e2e_1gpu.json] [XLA_CLIENT_MEM_FRACTION=0.5] \
#     bash scripts/bench_e2e_node.sh OUT_DIR [extra --config overrides]
#
# MICRO: samples per micro-batch on each GPU (train.num_micro_batches follows from it), in a JAX pool of
# XLA_CLIENT_MEM_FRACTION of each GPU. 2 and 0.5 by default: with the trainer on several GPUs NCCL needs room
# that one GPU's 4 samples at 0.55-0.56 do not leave (2 H200s, 2026-11-26: out of memory either beside the engine
# at the first all-reduce or inside the pool, placing the update's 31.7 GiB of temporaries with 0.8 GiB to spare).
set -euo pipefail
out=${1:?usage: bench_e2e_node.sh OUT_DIR [overrides]}; shift
micro=${MICRO:-2} steps=${STEPS:-3} model=${MODEL_DIR:-/tmp/qwen_random}
command -v nvidia-smi >/dev/null || { echo "bench_e2e_node.sh runs on a GPU node: no nvidia-smi here" >&2; exit 2; }
gpus=$(nvidia-smi -L | wc -l)
read -r samples < <(python3 -c "
import importlib.util as u; s = u.spec_from_file_location('r', 'configs/qwen_ocr.py'); m = u.module_from_spec(s)
s.loader.exec_module(m); c = m.get_config()
print(c.sample.prompts_per_step * c.sample.group_size // c.train.num_mini_batches)")
(( samples % (micro * gpus) == 0 )) ||
  { echo "MICRO=$micro x $gpus GPUs does not divide an update's $samples samples" >&2; exit 2; }
mkdir -p "$out"
unset XLA_PYTHON_CLIENT_MEM_FRACTION  # jax >= 0.11 ignores the GPU when both fractions are set
export XLA_PYTHON_CLIENT_PREALLOCATE=true XLA_CLIENT_MEM_FRACTION=${XLA_CLIENT_MEM_FRACTION:-0.5} PYTHONUNBUFFERED=1
[ -f "$model/model_index.json" ] || python3 scripts/make_random_pipeline.py --out "$model" --no-transformer-weights
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}  # the head makes a token (~/.ray/auth_token); the trainer asks for it
python3 -m ray.scripts.scripts start --head --num-gpus="$gpus" --disable-usage-stats >"$out/ray_start.log" 2>&1
trap 'python3 -m ray.scripts.scripts stop >/dev/null 2>&1' EXIT
overrides=(--config.model.path="$model" --config.model.init=random --config.rollout.layout=colocated
  --config.rollout.num_gpus=1 --config.rollout.num_servers="$gpus"
  --config.train.num_micro_batches=$((samples / micro / gpus))
  --config.train.num_steps="$steps" --config.eval.every=0 --config.checkpoint.every=1000 --config.log.progress=False
  --config.run_dir="$out/run" "$@")
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 >"$out/gpu_mem.csv" 2>/dev/null &
smi=$!
bash launch/ray_train.sh configs/qwen_ocr.py "${overrides[@]}" 2>&1 |
  while IFS= read -r line; do printf '%(%H:%M:%S)T %s\n' -1 "$line"; done | tee "$out/train.log"
kill "$smi" 2>/dev/null || true
python3 -m jaxflow_bench.summary "$out/run" --gpus "$gpus" --result e2e_8gpu --out "$out" --gpu-mem "$out/gpu_mem.csv" \
  --command "${MICRO:+MICRO=$MICRO }${STEPS:+STEPS=$STEPS }XLA_CLIENT_MEM_FRACTION=$XLA_CLIENT_MEM_FRACTION \
${ONE_GPU:+ONE_GPU=$ONE_GPU }bash scripts/bench_e2e_node.sh OUT $*"
[ -z "${ONE_GPU:-}" ] || python3 - "$out/e2e_8gpu.json" "$ONE_GPU" <<'PY'
import json, sys
from pathlib import Path
from jaxflow_bench.results import write_result
node, one = (json.loads(Path(p).read_text()) for p in sys.argv[1:])
figures = dict(node["figures"], one_gpu_img_per_gpu_s=one["figures"]["img_per_gpu_s"],
               scaling_efficiency=node["figures"]["img_per_gpu_s"] / one["figures"]["img_per_gpu_s"])
print(write_result(Path(sys.argv[1]).parent, "e2e_8gpu", figures, command=node["command"]))
PY
