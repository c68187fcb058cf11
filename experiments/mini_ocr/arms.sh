#!/usr/bin/env bash
# The algorithm arms of the mini OCR proof over several pipelines on one host's GPUs (BENCHMARKS.md, "Mini OCR: the
# algorithm arms"): first PIPELINES pipelines are built from nothing (OUT/p0, OUT/p1, ..., one a GPU at a time), then
# every (pipeline, arm) run takes the next free GPU, alone on it, then OUT/mini_ocr_algorithms.json
# (experiments.mini_ocr.algorithms). Each run is `experiments/mini_ocr/run.sh` with its ARM, so the arms share a
# pipeline.
#
#   [GPUS=4] [PIPELINES=2] [ARMS="nft flowgrpo"] [MINUTES=8.75] bash experiments/mini_ocr/arms.sh OUT
#   SMOKE=1 GPUS=2 PIPELINES=1 ARMS="flowgrpo nft" bash experiments/mini_ocr/arms.sh /tmp/arms   # toy size, CPU
#
# GPUS: default every GPU nvidia-smi lists (1 without one); PIPELINES: default GPUS; ARMS: of flowgrpo, nft, guard,
# corrected, dropzero, mixgrpo, awm (default all seven); MINUTES: each RL run's train.max_minutes; other
# experiments/mini_ocr/run.sh knobs (SMOKE, RL_ARGS, PRETRAIN_STEPS, EVAL_NUM, POOL, ...) pass through. Logs:
# OUT/build_pN.log, OUT/pN_ARM.log; OUT/status gets a line per finished command. A pipeline already built
# (OUT/pN/eval/before.json) is reused, not built again. Exit 1 if any command failed (the others still run and are
# collected).
set -euo pipefail
OUT=${1:?usage: [GPUS=N] [PIPELINES=N] [ARMS="..."] [MINUTES=M] bash experiments/mini_ocr/arms.sh OUT}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
GPUS=${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l || true)}
[[ "$GPUS" -ge 1 ]] || GPUS=1
PIPELINES=${PIPELINES:-$GPUS}
ARMS=${ARMS:-flowgrpo nft guard corrected dropzero mixgrpo awm}
MINUTES=${MINUTES:-8.75}
for arm in $ARMS; do
  case $arm in flowgrpo | nft | guard | corrected | dropzero | mixgrpo | awm) ;;
    *) echo "error: ARMS: unknown arm $arm; choose from flowgrpo nft guard corrected dropzero mixgrpo awm" >&2
       exit 2 ;; esac
done

launch() {  # launch GPU build|run PIPELINE [ARM]: one experiments/mini_ocr/run.sh command alone on GPU
  local gpu=$1 what=$2 p=$3 arm=${4:-} rc=0 suffix only
  if [[ $what == build ]]; then
    CUDA_VISIBLE_DEVICES=$gpu ONLY="data vae encode pretrain eval_before" bash experiments/mini_ocr/run.sh "$OUT/$p" \
      > "$OUT/build_$p.log" 2>&1 || rc=$?
  else
    suffix=$arm only="rl eval_after"
    [[ $arm == flowgrpo ]] && suffix=""
    [[ $arm == nft ]] && only="eval_before rl eval_after"  # NFT's "before" is without CFG
    CUDA_VISIBLE_DEVICES=$gpu ONLY="$only" ARM="$suffix" \
      RL_ARGS="--config.train.max_minutes=$MINUTES ${RL_ARGS:-}" bash experiments/mini_ocr/run.sh "$OUT/$p" \
      > "$OUT/${p}_$arm.log" 2>&1 || rc=$?
  fi
  echo "$what $p $arm gpu=$gpu rc=$rc $(date +%T)" >> "$OUT/status"
}

queue() {  # queue "build|run PIPELINE [ARM]"...: each on the next free GPU, then wait for all
  local job gpu
  local -a pids=()
  for job in "$@"; do
    while :; do
      for ((gpu = 0; gpu < GPUS; gpu++)); do
        if [[ -z "${pids[gpu]:-}" ]] || ! kill -0 "${pids[gpu]}" 2>/dev/null; then break 2; fi
      done
      sleep 1
    done
    # shellcheck disable=SC2086  # job's words are its arguments
    launch "$gpu" $job &
    pids[gpu]=$!
  done
  wait
}

pipelines=() builds=() runs=()
for ((i = 0; i < PIPELINES; i++)); do
  pipelines+=("p$i")
  [[ -f "$OUT/p$i/eval/before.json" ]] || builds+=("build p$i")
done
for p in "${pipelines[@]}"; do for arm in $ARMS; do runs+=("run $p $arm"); done; done
: > "$OUT/status"
[[ ${#builds[@]} == 0 ]] || queue "${builds[@]}"
queue "${runs[@]}"
python -m experiments.mini_ocr.algorithms --out "$OUT" --pipelines "${pipelines[@]/#/$OUT/}"
! grep -qv "rc=0 " "$OUT/status"
