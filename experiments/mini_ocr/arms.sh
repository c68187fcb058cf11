#!/usr/bin/env bash
# The algorithm arms of the mini OCR proof over several pipelines on one host's GPUs (BENCHMARKS.md, "Mini OCR: the
# algorithm arms"): first PIPELINES pipelines are built from nothing (OUT/p0, OUT/p1, ..., all at once, one a GPU),
# then (with nft or cfgfree in ARMS) each pipeline's "before" eval without CFG, (with omni or omni_fp8) each
# pipeline's bf16 copy and its "before" eval, then every (pipeline, arm) run
# takes the next free slot, PER_GPU runs side by side on a GPU, then OUT/mini_ocr_algorithms.json and, for omni and
# omni_fp8, OUT/mini_ocr_fp8.json (experiments.mini_ocr.algorithms). Each run is `experiments/mini_ocr/run.sh` with
# its ARM, so the arms share a pipeline.
#
#   [GPUS=4] [PIPELINES=2] [PER_GPU=2] [ARMS="nft flowgrpo"] [MINUTES=8.75] bash experiments/mini_ocr/arms.sh OUT
#   SMOKE=1 GPUS=1 PER_GPU=2 PIPELINES=1 ARMS="flowgrpo nft" bash experiments/mini_ocr/arms.sh /tmp/arms  # toy, CPU
#
#   ARMS="omni omni_fp8" bash experiments/mini_ocr/arms.sh OUT  # the FP8 rollout against bf16 (docs/mini_ocr.md)
#
# GPUS, PER_GPU (POOL 0.3 at two), PIPELINES, MINUTES: experiments/mini_ocr/jobs.sh. ARMS: of flowgrpo, nft, guard,
# corrected, dropzero, mixgrpo, mixgrpo_flash, awm (the default: these eight), cfgfree, omni, omni_fp8. Other
# experiments/mini_ocr/run.sh knobs (SMOKE, RL_ARGS, PRETRAIN_STEPS, EVAL_NUM, ...) pass through; with
# EVAL_ALSO_STEPS=N the evals at N steps are collected too (OUT/mini_ocr_algorithms_sN.json). Logs:
# OUT/build_pN.log, OUT/pN_ARM.log; OUT/status gets a line per finished command. A pipeline already built (OUT/pN/eval/before.json) is reused. Exit 1 if any command failed (the
# others still run and are collected).
set -euo pipefail
OUT=${1:?usage: [GPUS=N] [PIPELINES=N] [PER_GPU=N] [ARMS="..."] [MINUTES=M] bash experiments/mini_ocr/arms.sh OUT}
cd "$(dirname "$0")/../.."
ARMS=${ARMS:-flowgrpo nft guard corrected dropzero mixgrpo mixgrpo_flash awm}
for arm in $ARMS; do
  case $arm in flowgrpo | nft | guard | corrected | dropzero | cfgfree | mixgrpo | mixgrpo_flash | awm | omni | omni_fp8) ;;
    *) echo "error: ARMS: unknown arm $arm; choose from flowgrpo nft guard corrected dropzero cfgfree mixgrpo" \
            "mixgrpo_flash awm omni omni_fp8" >&2
       exit 2 ;; esac
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
source experiments/mini_ocr/jobs.sh

run() {  # run GPU PIPELINE ARM: the arm's RL run and its eval after
  local suffix=$3
  [[ $3 == flowgrpo ]] && suffix=""
  CUDA_VISIBLE_DEVICES=$1 ONLY="rl eval_after" ARM="$suffix" \
    RL_ARGS="--config.train.max_minutes=$MINUTES ${RL_ARGS:-}" bash experiments/mini_ocr/run.sh "$OUT/$2" \
    > "$OUT/${2}_$3.log" 2>&1
}

omni_base() {  # omni_base GPU PIPELINE: the bf16 folder both omni arms train on and its "before" eval, once
  CUDA_VISIBLE_DEVICES=$1 ONLY="bf16 eval_before" ARM=omni bash experiments/mini_ocr/run.sh "$OUT/$2" \
    > "$OUT/${2}_omni_base.log" 2>&1
}

: > "$OUT/status"
build_pipelines
[[ " $ARMS " != *" nft "* && " $ARMS " != *" cfgfree "* ]] || cfg_free_befores
if [[ " $ARMS " == *" omni"* ]]; then
  bases=()
  for p in "${pipelines[@]}"; do [[ -f "$OUT/$p/eval/before_omni.json" ]] || bases+=("omni_base $p"); done
  [[ ${#bases[@]} == 0 ]] || queue "$GPUS" "${bases[@]}"
fi
todo=()
for p in "${pipelines[@]}"; do for arm in $ARMS; do todo+=("$p $arm"); done; done
run_all "${todo[@]}"
python -m experiments.mini_ocr.algorithms --out "$OUT" --pipelines "${pipelines[@]/#/$OUT/}"
for n in ${EVAL_ALSO_STEPS:-}; do
  python -m experiments.mini_ocr.algorithms --out "$OUT" --pipelines "${pipelines[@]/#/$OUT/}" --eval-steps "$n"
done
! failed
