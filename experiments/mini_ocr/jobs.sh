#!/usr/bin/env bash
# Sourced by experiments/mini_ocr/arms.sh and sweep.sh: experiments/mini_ocr/run.sh commands over one host's GPUs.
# Needs OUT and sets GPUS (default every GPU nvidia-smi lists, 1 without one), PER_GPU (runs side by side on each GPU,
# default 1; POOL, each trainer's JAX memory fraction, defaults to 0.6 / PER_GPU when it is above 1: 0.3 for two),
# PIPELINES (default GPUS) and MINUTES (each RL run's train.max_minutes, default 8.75). `build_pipelines` builds OUT/pN
# (one a GPU, all at once; one with OUT/pN/eval/before.json is reused); `run_all JOB...` runs each JOB, "PIPELINE
# NAME", on the next free slot (slot i on GPU i % GPUS) as `run GPU PIPELINE NAME` (the caller's function: one
# run.sh command, its log OUT/PIPELINE_NAME.log); `cfg_free_befores` evaluates each pipeline without CFG once
# (eval/before_nft.json, for the arms that train without it). OUT/status gets a line per finished command.
GPUS=${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l || true)}
[[ "$GPUS" -ge 1 ]] || GPUS=1
PER_GPU=${PER_GPU:-1}
[[ "$PER_GPU" =~ ^[1-9][0-9]*$ ]] || { echo "error: PER_GPU=$PER_GPU: a whole number >= 1 (runs a GPU)" >&2; exit 2; }
if [[ $PER_GPU -gt 1 ]]; then POOL=${POOL:-$(awk -v n="$PER_GPU" 'BEGIN {printf "%.2g", 0.6 / n}')}; fi
[[ -z "${POOL:-}" ]] || export POOL
PIPELINES=${PIPELINES:-$GPUS}
MINUTES=${MINUTES:-8.75}
pipelines=()
for ((i = 0; i < PIPELINES; i++)); do pipelines+=("p$i"); done

queue() {  # queue SLOTS COMMAND...: each COMMAND (words; its GPU appended first) on the next free slot, then wait
  local slots=$1 job slot
  shift
  local -a pids=()
  for job in "$@"; do
    while :; do
      for ((slot = 0; slot < slots; slot++)); do
        if [[ -z "${pids[slot]:-}" ]] || ! kill -0 "${pids[slot]}" 2>/dev/null; then break 2; fi
      done
      sleep 1
    done
    # shellcheck disable=SC2086  # job's words are its arguments
    logged $((slot % GPUS)) $job &
    pids[slot]=$!
  done
  wait
}

logged() {  # logged GPU FUNCTION ARG...: FUNCTION GPU ARG..., its exit status a line of OUT/status
  local gpu=$1 fn=$2 rc=0
  shift 2
  "$fn" "$gpu" "$@" || rc=$?
  echo "$fn $* gpu=$gpu rc=$rc $(date +%T)" >> "$OUT/status"
}

build() {  # build GPU PIPELINE: data, VAE, encode, pretrain and the "before" eval, alone on the GPU
  POOL= CUDA_VISIBLE_DEVICES=$1 ONLY="data vae encode pretrain eval_before" bash experiments/mini_ocr/run.sh \
    "$OUT/$2" > "$OUT/build_$2.log" 2>&1
}

build_pipelines() {
  local p
  local -a builds=()
  for p in "${pipelines[@]}"; do [[ -f "$OUT/$p/eval/before.json" ]] || builds+=("build $p"); done
  [[ ${#builds[@]} == 0 ]] || queue "$GPUS" "${builds[@]}"
}

nft_before() {  # nft_before GPU PIPELINE: the pipeline's CFG-free "before" eval (eval/before_nft.json)
  CUDA_VISIBLE_DEVICES=$1 ONLY="eval_before" ARM=nft bash experiments/mini_ocr/run.sh "$OUT/$2" \
    > "$OUT/${2}_nft_before.log" 2>&1
}

cfg_free_befores() {  # nft_before on each pipeline without one, one a GPU (the CFG-free arms rise from it)
  local p
  local -a todo=()
  for p in "${pipelines[@]}"; do [[ -f "$OUT/$p/eval/before_nft.json" ]] || todo+=("nft_before $p"); done
  [[ ${#todo[@]} == 0 ]] || queue "$GPUS" "${todo[@]}"
}

run_all() {  # run_all "PIPELINE NAME"...
  local job
  local -a todo=()
  for job in "$@"; do todo+=("run $job"); done
  queue $((GPUS * PER_GPU)) "${todo[@]}"
}

failed() {  # true if any command in OUT/status failed
  grep -qv "rc=0 " "$OUT/status"
}
