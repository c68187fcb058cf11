#!/usr/bin/env bash
# The knob sweep of the mini OCR proof on one host's GPUs: each variant of experiments/mini_ocr/sweep.py
# (configs/mini_ocr.py's FlowGRPO or NFT arm with a few --config overrides) on each pipeline, as
# experiments/mini_ocr/arms.sh runs the arms (the same pipelines, built first where missing; NFT's CFG-free "before"
# eval once a pipeline), then OUT/mini_ocr_sweep.json (each variant's rise and its paired difference with its arm as
# configured: baseline, or nft).
#
#   [GPUS=4] [PIPELINES=2] [PER_GPU=2] [VARIANTS="baseline lr2x ..."] [MINUTES=7] bash experiments/mini_ocr/sweep.sh OUT
#   SMOKE=1 GPUS=1 PER_GPU=2 PIPELINES=1 VARIANTS="baseline lr2x" bash experiments/mini_ocr/sweep.sh /tmp/sweep  # CPU
#   VARIANTS="nft nft_decay1 nft_decay0" MINUTES=9.5 bash experiments/mini_ocr/sweep.sh OUT  # NFT's old-policy decay
#   VARIANTS="nft nft_lr2x nft_rank64" MINUTES=9.5 bash experiments/mini_ocr/sweep.sh OUT  # NFT's step and capacity
#
# VARIANTS: names of experiments/mini_ocr/sweep.py's VARIANTS (default its FIRST sweep, baseline and 7 variants);
# GPUS, PER_GPU, PIPELINES, MINUTES: experiments/mini_ocr/jobs.sh; other experiments/mini_ocr/run.sh knobs (SMOKE,
# RL_ARGS, ...) pass through, RL_ARGS before the variant's overrides; with EVAL_ALSO_STEPS=N the evals at N steps are
# collected too (OUT/mini_ocr_sweep_sN.json). Each run: RUN=sweep_NAME, logs OUT/pN_sweep_NAME.log. Exit 1 if any
# command failed (the others still run and are collected).
set -euo pipefail
OUT=${1:?usage: [GPUS=N] [PIPELINES=N] [PER_GPU=N] [VARIANTS="..."] [MINUTES=M] bash experiments/mini_ocr/sweep.sh OUT}
cd "$(dirname "$0")/../.."
VARIANTS=${VARIANTS:-$(python -c "from experiments.mini_ocr.sweep import FIRST; print(*FIRST)")}
declare -A ARGS ARM_OF
for name in $VARIANTS; do
  ARGS[$name]=$(python -m experiments.mini_ocr.sweep args "$name") || exit 2
  ARM_OF[$name]=$(python -m experiments.mini_ocr.sweep arm "$name")
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
source experiments/mini_ocr/jobs.sh

run() {  # run GPU PIPELINE VARIANT: the variant's RL run and its eval after
  CUDA_VISIBLE_DEVICES=$1 ONLY="rl eval_after" ARM="${ARM_OF[$3]}" RUN="sweep_$3" \
    RL_ARGS="--config.train.max_minutes=$MINUTES ${RL_ARGS:-} ${ARGS[$3]}" bash experiments/mini_ocr/run.sh \
    "$OUT/$2" > "$OUT/${2}_sweep_$3.log" 2>&1
}

: > "$OUT/status"
build_pipelines
[[ " ${ARM_OF[*]} " != *" nft "* ]] || cfg_free_befores
todo=()
for p in "${pipelines[@]}"; do for name in $VARIANTS; do todo+=("$p $name"); done; done
run_all "${todo[@]}"
python -m experiments.mini_ocr.sweep collect --out "$OUT" --pipelines "${pipelines[@]/#/$OUT/}"
for n in ${EVAL_ALSO_STEPS:-}; do
  python -m experiments.mini_ocr.sweep collect --out "$OUT" --pipelines "${pipelines[@]/#/$OUT/}" --eval-steps "$n"
done
! failed
