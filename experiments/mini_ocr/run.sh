#!/usr/bin/env bash
# The mini OCR proof from nothing, on one GPU: render data -> train the VAE -> encode -> pretrain the
# Flax transformer -> OCR before -> FlowGRPO (python -m jaxflow.train, configs/mini_ocr.py) -> OCR after -> the
# shuffled-reward control -> OUT/mini_ocr.json. Every step is sized (or time-capped) to finish within 10 minutes
# on one H200; OUT/timings.txt records each. Weights and data stay under OUT.
#
#   bash experiments/mini_ocr/run.sh OUT                   # the GPU run
#   SMOKE=1 bash experiments/mini_ocr/run.sh /tmp/mini     # every step at toy size on the CPU (a few minutes)
#   ONLY="data vae encode" bash experiments/mini_ocr/run.sh OUT   # only these steps (commands capped at 10 minutes);
#   steps: data vae encode pretrain bf16 (the omni arms') eval_before eval_before_train rl rl_control eval_after
#   eval_after_train eval_control result
# SIDE_BY_SIDE=0 (default) runs the evals, the RL run and its control one at a time, each alone on the GPU (more
# steps per minute: docs/mini_ocr.md); SIDE_BY_SIDE=1 runs the two evals before, the RL run and its control, and the three
# evals after side by side on the one GPU.
#
# Each step's time on one H200, the sizing of the VAE and pretraining, and every run: docs/mini_ocr.md.
# Each RL run ends by itself within 10 minutes: configs/mini_ocr.py's train.max_minutes=8.75 (as many steps as fit,
# then the checkpoint and lora_final). Knobs (env): PRETRAIN_STEPS (default 1000; fewer if the "before" OCR is near
# 1: RL needs room), PRETRAIN_MINUTES (time cap, default 9), VAE_STEPS (default 6000), VAE_MINUTES (time cap,
# default 5), RL_STEPS (default: the config's), RL_ARGS (more --config overrides of both RL runs, e.g.
# --config.train.max_minutes=5), EVAL_NUM (200), RL_TIMEOUT (seconds: a hard stop of an RL run; it checkpoints the
# current step and this script exports that step's LoRA as lora_final), RL_RESUME=1 (continue such a run:
# ONLY="rl rl_control" RL_RESUME=1 ...), POOL (each trainer's JAX memory fraction of the GPU: 0.3 side by side,
# 0.5 alone; lower it when more runs share the GPU), and EVAL_ALSO_STEPS (e.g. 40: every eval again at these
# denoising steps into eval/NAME_s40.json beside eval/NAME.json; flow_grpo and verl-omni evaluate OCR at 40
# steps). ARM (configs/mini_ocr.py's ARMS: "" FlowGRPO, guard, corrected,
# dropzero, cfgfree, nft, mixgrpo, mixgrpo_flash, awm, omni, omni_fp8) picks the algorithm (omni: the rollout engine)
# of the RL run and its control (and, for cfgfree and nft, evals without CFG); an arm's runs,
# evals, timings and result are named for it (OUT/rl_nft, OUT/eval/after_nft.json, mini_ocr_nft.json), so every arm can train on one
# pipeline, at once on several GPUs:
#   ONLY="rl eval_after" ARM=guard CUDA_VISIBLE_DEVICES=1 bash experiments/mini_ocr/run.sh OUT
# (cfgfree and nft also need their eval_before: without CFG, eval/before_nft.json; omni and omni_fp8 the bf16 folder and its
# eval_before, eval/before_omni.json, once for both: ONLY="bf16 eval_before" ARM=omni). RUN names the run's files instead of ARM (a
# variant of an arm set by RL_ARGS, as experiments/mini_ocr/sweep.sh runs them: ONLY="rl eval_after" RUN=sweep_lr2x).
set -euo pipefail
OUT=${1:?usage: [SMOKE=1] bash experiments/mini_ocr/run.sh OUT}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export HF_HUB_OFFLINE=1

if [[ "${SMOKE:-0}" == 1 ]]; then
  DEVICE=cpu
  DATA=(--train 64 --test 16 --variants 2)
  VAE=(--steps "${VAE_STEPS:-100}" --batch 4 --crop 32x64 --size toy --max-minutes 2)
  PRE=(--steps "${PRETRAIN_STEPS:-30}" --batch 8 --dtype float32 --ema 0.9 --log-every 10 --max-minutes 2)
  EVAL=(--num "${EVAL_NUM:-8}" --steps 4 --device cpu)
  RL=(--config.rollout.device=cpu --config.rollout.num_gpus=0 --config.train.num_steps="${RL_STEPS:-2}"
      --config.sample.prompts_per_step=2 --config.sample.group_size=2 --config.sample.prompts_per_call=2
      --config.sample.num_steps=4 --config.sample.window_size=3 --config.sample.window_range="(0, 3)"
      --config.eval.num_steps=4
      --config.eval.every=2 --config.eval.num_prompts=4 --config.reward.workers=1 ${RL_ARGS:-})
else
  DEVICE=cuda
  DATA=(--train 4000 --test 200 --variants 4)
  # 32x64 crops, 16 a step: whole 64x128 signs 64 a step stalled at the blank-sign loss (docs/mini_ocr.md)
  VAE=(--steps "${VAE_STEPS:-6000}" --batch 16 --crop 32x64 --size mini --max-minutes "${VAE_MINUTES:-5}" --min-ocr 0.8)
  # 1000 steps: held-out OCR well below 1, so RL has room (the OCR after each length: docs/mini_ocr.md)
  PRE=(--steps "${PRETRAIN_STEPS:-1000}" --batch 256 --dtype bfloat16 --ema 0.99 --max-minutes "${PRETRAIN_MINUTES:-9}")
  EVAL=(--num "${EVAL_NUM:-200}" --steps 10 --device cuda)
  RL=(${RL_STEPS:+--config.train.num_steps=$RL_STEPS} ${RL_ARGS:-})  # RL_ARGS: more --config overrides
  # one GPU shared by JAX and the in-process torch engine: a fixed JAX pool (README, "Running for real"); with
  # SIDE_BY_SIDE two trainers share it, each with 0.3 (and fewer reward workers: RL_ARGS=--config.reward.workers=7)
  pool=0.5
  [[ "${SIDE_BY_SIDE:-0}" == 1 ]] && pool=0.3
  export XLA_PYTHON_CLIENT_PREALLOCATE=true XLA_CLIENT_MEM_FRACTION=${POOL:-$pool}
fi

EVAL+=(${EVAL_ALSO_STEPS:+--also-steps $EVAL_ALSO_STEPS})
ARM=${ARM:-}
BEFORE=before  # NFT's and cfgfree's policies are CFG-free: their evals, the "before" too, run without CFG (before_nft)
[[ "$ARM" == nft || "$ARM" == cfgfree ]] && EVAL+=(--guidance 1) && BEFORE=before_nft
# the vLLM-Omni arms train on the folder's bf16 copy (step bf16): their evals, "before" too (before_omni), run on it
PIPELINE=pipeline
[[ "$ARM" == omni || "$ARM" == omni_fp8 ]] && PIPELINE=pipeline_bf16 && BEFORE=before_omni
RL_CONFIG=configs/mini_ocr.py${ARM:+:$ARM} CONTROL_CONFIG=configs/mini_ocr.py:${ARM:+${ARM}_}control
RUN=${RUN:-$ARM}
A=${RUN:+_$RUN}  # the run's suffix of run, eval and timing names

step() {  # step NAME COMMAND...: run, time, log (skipped when ONLY is set and does not name it)
  local name=$1 start=$SECONDS
  shift
  [[ -z "${ONLY:-}" || " $ONLY " == *" $name "* ]] || return 0
  echo "== $name: $*"
  "$@"
  case $name in rl* | eval_* | result) name=$name$A ;; esac
  echo "$name $((SECONDS - start)) s" | tee -a "$OUT/timings.txt"
}

pids=()
together() {  # together COMMAND...: in the background under SIDE_BY_SIDE=1, else now; `join` waits
  if [[ "${SIDE_BY_SIDE:-0}" == 1 ]]; then "$@" & pids+=($!); else "$@"; fi
}
join() {  # wait for every `together` command; fail if any failed
  local p rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  pids=()
  return $rc
}

rl() {  # rl RUN_DIR CONFIG: a new run, or with RL_RESUME=1 the continuation of one cut by RL_TIMEOUT
  local start=--overwrite rc=0 args
  [[ "${RL_RESUME:-0}" == 1 ]] && start=--resume
  args=(--config "$2" --config.model.path="$OUT/$PIPELINE" --config.run_dir="$1"
        --config.data.train="$OUT/data/train.txt" --config.data.test="$OUT/data/test.txt" --config.log.progress=False)
  timeout --kill-after=30 "${RL_TIMEOUT:-0}" python -m jaxflow.train "${args[@]}" "$start" "${RL[@]}" || rc=$?
  [[ $rc == 124 || $rc == 137 ]] || return $rc
  # cut by RL_TIMEOUT: the stop request checkpointed the current step; export that step's LoRA as lora_final
  local newest
  newest=$(ls "$1/checkpoints" | grep -E '^[0-9]+$' | sort -n | tail -n 1)
  echo "$1: cut by RL_TIMEOUT=${RL_TIMEOUT}s; exporting the LoRA of its newest checkpoint, step $newest"
  python -m jaxflow.train "${args[@]}" --resume "${RL[@]}" --config.train.num_steps="$newest"
}

[[ -n "${ONLY:-}" ]] || : > "$OUT/timings.txt"
step data python -m experiments.mini_ocr.prepare data --out "$OUT" "${DATA[@]}"
step vae python -m experiments.mini_ocr.prepare vae --out "$OUT" --device "$DEVICE" "${VAE[@]}"
step encode python -m experiments.mini_ocr.prepare encode --out "$OUT" --device "$DEVICE"
step pretrain python -m experiments.mini_ocr.pretrain --pipeline "$OUT/pipeline" --data "$OUT/data" "${PRE[@]}"
[[ $PIPELINE == pipeline ]] || step bf16 python -m experiments.mini_ocr.prepare bf16 --out "$OUT"
ev() {  # ev NAME PROMPTS [--lora DIR]: OCR of the pipeline (+ LoRA) on PROMPTS -> OUT/eval/NAME.{json,png}
  local name=$1 prompts=$2
  shift 2
  python -m experiments.mini_ocr.evaluate --pipeline "$OUT/$PIPELINE" --prompts "$prompts" \
    --json "$OUT/eval/$name.json" --grid "$OUT/eval/$name.png" "$@" "${EVAL[@]}"
}
# the train words too: RL trains on them, so they must also score well below 1 (else lower PRETRAIN_STEPS)
together step eval_before ev "$BEFORE" "$OUT/data/test.txt"
together step eval_before_train ev "${BEFORE}_train" "$OUT/data/train.txt"
join
together step rl rl "$OUT/rl$A" "$RL_CONFIG"
together step rl_control rl "$OUT/rl${A}_control" "$CONTROL_CONFIG"
join
together step eval_after ev "after$A" "$OUT/data/test.txt" --lora "$OUT/rl$A/lora_final"
together step eval_after_train ev "after${A}_train" "$OUT/data/train.txt" --lora "$OUT/rl$A/lora_final"
together step eval_control ev "control$A" "$OUT/data/test.txt" --lora "$OUT/rl${A}_control/lora_final"
join
step result python -m experiments.mini_ocr.result --out "$OUT" ${RUN:+--arm "$RUN"} \
  --rl-seconds "$(awk -v n="rl$A" '$1 == n {s = $2} END {print s}' "$OUT/timings.txt")"
