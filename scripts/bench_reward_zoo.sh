#!/usr/bin/env bash
# The recipe end to end on one GPU with a PickScore + OCR reward mix: a random full-size PickScore
# (scripts/make_random_pickscore.py) scores in a Ray actor of its own on the same GPU (its default float32, a tenth of
# the GPU in Ray's count, the rollout actor the rest), overlapping the rollout as the OCR pool does; 3 timed steps;
# writes OUT_DIR/reward_zoo.json with the reward time per step (jaxflow_bench.e2e's figures). The pipeline is the
# random one with a 2-layer text encoder (MODEL_DIR, written if missing): beside JAX's pool and the engine, the
# full-size text encoder leaves no room on one H200 for a second model (the engine's start runs out of memory).
#
#   [PROMPTS=2] [MODEL_DIR=/tmp/qwen_short] bash scripts/bench_reward_zoo.sh OUT_DIR [extra --config overrides]
set -euo pipefail
out=${1:?usage: bench_reward_zoo.sh OUT_DIR [overrides]}; shift
pick=${PICKSCORE_DIR:-/tmp/pickscore_random}
model=${MODEL_DIR:-/tmp/qwen_short}
[ -f "$pick/config.json" ] || python3 scripts/make_random_pickscore.py --out "$pick"
[ -f "$model/model_index.json" ] || python3 scripts/make_random_pipeline.py --out "$model" --no-transformer-weights \
  --text-encoder short
python -m jaxflow_bench.e2e "$out" --result "${RESULT:-reward_zoo}" ${PROMPTS:+--prompts "$PROMPTS"} \
  --model-dir "$model" --config.rollout.num_gpus=0.9 \
  "--config.reward.fns={'ocr': 1.0, 'pickscore': 1.0}" \
  "--config.reward.options={'ocr': {'num_threads': 2}, 'pickscore': {'path': '$pick', 'device': 'cuda', 'batch_size': 16, 'actor': {'num_gpus': 0.1, 'num_cpus': 1}}}" \
  "$@"
