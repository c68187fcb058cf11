#!/usr/bin/env bash
# The mini edit proof from nothing, on one GPU (or two: the RL run and its control on one each), planned after
# experiments/mini_ocr/run.sh: sign-edit data -> the sign VAE -> encode -> pretrain a tiny Qwen-Image-Edit-shaped model
# to edit sign text, saving snapshots -> pick the snapshot whose held-out edit-OCR is closest to PICK_TARGET -> edit-OCR
# before -> FlowGRPO with the edit_ocr reward (python -m jaxflow.train, configs/mini_edit.py) and its shuffled-reward
# control -> edit-OCR after -> OUT/mini_edit.json. The proof asks a rise >= 0.2 within one 10-minute RL run, and a
# control that does not rise, so "before" must leave room (below ~0.75) while the model already edits somewhat (above
# ~0.2). Every step is sized (or time-capped) to finish within 10 minutes on one H200 (docs/mini_edit.md);
# OUT/timings.txt records each.
# Weights and data stay under OUT.
#
#   bash experiments/mini_edit/run.sh OUT                   # the GPU run
#   SMOKE=1 bash experiments/mini_edit/run.sh /tmp/edit     # every step at toy size on the CPU
#   ONLY="data vae encode" bash experiments/mini_edit/run.sh OUT   # only these steps
#   steps: data vae encode pretrain pick eval_before rl rl_control eval_after eval_control result
#
# Steps: data (experiments/mini_edit/signs.py: OUT/data/{train,test}.jsonl + source PNGs, pairs.npz the pretraining
# feed); vae and encode (experiments/mini_edit/prepare.py: mini_ocr's sign VAE on the pairs' source and edited signs,
# the edit pipeline folder OUT/pipeline, the pairs' latents and VL embeds); pretrain (experiments/mini_edit/pretrain.py:
# mini_ocr's flow-matching loop over (source latents, instruction) -> edited latents, one run of the largest
# PICK_STEPS, the EMA weights saved at each as OUT/snapshots/STEP/transformer/); pick (experiments/mini_edit/pick.py:
# each snapshot's edit-OCR on the first PICK_NUM held-out pairs, the closest to PICK_TARGET installed as
# OUT/pipeline/transformer/, OUT/pick.json); eval_* (experiments/mini_edit/evaluate.py: edit_ocr of ODE edits of the
# held-out pairs); result (experiments/mini_edit/result.py, with the picked step as pretrain_steps).
#
# What each run measured, why the pick step, and the results: docs/mini_edit.md.
# Knobs (env): PICK_STEPS (snapshot steps, comma-separated; the largest is the pretraining length; default
# 400,600,800,1000,1200,1500,2000), PICK_TARGET (0.5), PICK_NUM (48), PRETRAIN_MINUTES (9; snapshots after the cap
# are not written), VAE_STEPS (6000), VAE_MINUTES (5), RL_STEPS (default: the config's), RL_ARGS (more --config
# overrides of both RL runs), EVAL_NUM (200), POOL (the trainer's JAX memory fraction of the GPU, 0.5),
# RL_POOL (each side-by-side RL run's fraction, 0.3), ARM ("" FlowGRPO, or nft: DiffusionNFT, configs/mini_edit.py:nft
# and :nft_control, every eval without CFG as it trains; run it into an OUT of its own, or with ONLY from eval_before
# on an OUT whose pipeline is built).
# rl and rl_control run at once: with two or more GPUs visible (CUDA_VISIBLE_DEVICES, else nvidia-smi) each on its own
# (the first two), with the whole POOL; with one, side by side on it, RL_POOL of it each.
set -euo pipefail
OUT=${1:?usage: [SMOKE=1] [ONLY="data ..."] bash experiments/mini_edit/run.sh OUT}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export HF_HUB_OFFLINE=1
[[ -z "${PRETRAIN_STEPS:-}" ]] ||
  { echo "error: PRETRAIN_STEPS is replaced by PICK_STEPS (snapshot steps; the largest is the length)" >&2; exit 2; }

if [[ "${SMOKE:-0}" == 1 ]]; then
  DEVICE=cpu
  DATA=(--train 64 --test 16)
  VAE=(--steps "${VAE_STEPS:-100}" --batch 4 --crop 32x64 --size toy --max-minutes 2)
  PICK_STEPS=${PICK_STEPS:-10,20,30}
  PRE=(--batch 8 --dtype float32 --ema 0.9 --log-every 10 --max-minutes 2)
  EVAL=(--num "${EVAL_NUM:-8}" --steps 4 --device cpu)
  PICK=(--num "${PICK_NUM:-4}" --steps 4 --device cpu)
  RL=(--config.rollout.device=cpu --config.rollout.num_gpus=0 --config.train.num_steps="${RL_STEPS:-2}"
      --config.sample.prompts_per_step=2 --config.sample.group_size=2 --config.sample.prompts_per_call=2
      --config.sample.num_steps=4 --config.sample.window_size=3 --config.sample.window_range="(0, 3)"
      --config.eval.num_steps=4 --config.eval.every=2 --config.eval.num_prompts=4 --config.reward.workers=1)
else
  DEVICE=cuda
  DATA=(--train 4000 --test 200)
  VAE=(--steps "${VAE_STEPS:-6000}" --batch 16 --crop 32x64 --size mini --max-minutes "${VAE_MINUTES:-5}" --min-ocr 0.8)
  PICK_STEPS=${PICK_STEPS:-400,600,800,1000,1200,1500,2000}
  PRE=(--batch 256 --dtype bfloat16 --ema 0.99 --max-minutes "${PRETRAIN_MINUTES:-9}")
  EVAL=(--num "${EVAL_NUM:-200}" --steps 10 --device cuda)
  PICK=(--num "${PICK_NUM:-48}" --steps 10 --device cuda)
  RL=(${RL_STEPS:+--config.train.num_steps=$RL_STEPS} ${RL_ARGS:-})
  # one GPU shared by JAX and the in-process torch engine: a fixed JAX pool (README, "Running for real")
  export XLA_PYTHON_CLIENT_PREALLOCATE=true XLA_CLIENT_MEM_FRACTION=${POOL:-0.5}
fi
case ${ARM:-} in "") ;; nft) EVAL+=(--guidance 1) ;;  # the pick stays at the eval config's CFG
  *) echo "error: ARM: unknown arm '$ARM'; choose nft or leave it unset (FlowGRPO)" >&2; exit 2 ;; esac
CONFIG=configs/mini_edit.py${ARM:+:$ARM} CONTROL_CONFIG=configs/mini_edit.py:${ARM:+${ARM}_}control

STEPS=" data vae encode pretrain pick eval_before rl rl_control eval_after eval_control result "
for name in ${ONLY:-}; do
  [[ "$STEPS" == *" $name "* ]] || { echo "error: unknown mini_edit step '$name' in ONLY; steps:$STEPS" >&2; exit 2; }
done

step() {  # step NAME COMMAND...: run, time, log (skipped when ONLY is set and does not name it)
  local name=$1 start=$SECONDS
  shift
  [[ -z "${ONLY:-}" || " $ONLY " == *" $name "* ]] || return 0
  echo "== $name: $*"
  "$@"
  echo "$name $((SECONDS - start)) s" | tee -a "$OUT/timings.txt"
}

rl() {  # rl RUN_DIR CONFIG [VAR=VALUE ...]: one RL run on the pipeline and the edit data, in that environment
  local dir=$1 config=$2
  shift 2
  env "$@" python -m jaxflow.train --config "$config" --config.model.path="$OUT/pipeline" --config.run_dir="$dir" \
    --config.data.train="$OUT/data/train.jsonl" --config.data.test="$OUT/data/test.jsonl" \
    --config.log.progress=False --overwrite "${RL[@]}"
}

pretrain() {  # one pretraining run to the largest PICK_STEPS, a snapshot at each (the previous run's removed)
  rm -rf "$OUT/snapshots"
  python -m experiments.mini_edit.pretrain --pipeline "$OUT/pipeline" --data "$OUT/data" "${PRE[@]}" \
    --steps "$(tr , '\n' <<< "$PICK_STEPS" | sort -n | tail -1)" --save-at "$PICK_STEPS" --snapshots "$OUT/snapshots"
}

ev() {  # ev NAME [--lora DIR]: edit-OCR of the pipeline (+ LoRA) on the held-out pairs -> OUT/eval/NAME.{json,png}
  local name=$1
  shift
  python -m experiments.mini_edit.evaluate --pipeline "$OUT/pipeline" --data "$OUT/data/test.jsonl" \
    --json "$OUT/eval/$name.json" --grid "$OUT/eval/$name.png" "$@" "${EVAL[@]}"
}

[[ -n "${ONLY:-}" ]] || : > "$OUT/timings.txt"
step data python -m experiments.mini_edit.signs --out "$OUT/data" "${DATA[@]}" --pairs
step vae python -m experiments.mini_edit.prepare vae --out "$OUT" --device "$DEVICE" "${VAE[@]}"
step encode python -m experiments.mini_edit.prepare encode --out "$OUT" --device "$DEVICE"
step pretrain pretrain
step pick python -m experiments.mini_edit.pick --pipeline "$OUT/pipeline" --snapshots "$OUT"/snapshots/* \
  --data "$OUT/data/test.jsonl" --json "$OUT/pick.json" --target "${PICK_TARGET:-0.5}" "${PICK[@]}"
step eval_before ev before
sel() { [[ -z "${ONLY:-}" || " $ONLY " == *" $1 "* ]]; }
gpus() {  # the visible GPUs' ids: CUDA_VISIBLE_DEVICES's, else nvidia-smi's indices
  if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then tr , ' ' <<< "$CUDA_VISIBLE_DEVICES"
  else nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | tr '\n' ' '; fi
}
if [[ "$DEVICE" == cuda ]] && sel rl && sel rl_control; then  # at once: on two GPUs, else side by side on one
  read -r -a ids <<< "$(gpus)"
  if (( ${#ids[@]} >= 2 )); then  # each run alone on its GPU, with the whole POOL
    echo "== rl on GPU ${ids[0]}, rl_control on GPU ${ids[1]}: logs $OUT/rl.log, $OUT/rl_control.log"
    pin=(CUDA_VISIBLE_DEVICES="${ids[0]}"); pin_control=(CUDA_VISIBLE_DEVICES="${ids[1]}")
  else  # the one GPU shared, RL_POOL of it each
    echo "== rl and rl_control side by side on one GPU: logs $OUT/rl.log, $OUT/rl_control.log"
    pin=(XLA_CLIENT_MEM_FRACTION="${RL_POOL:-0.3}"); pin_control=("${pin[@]}")
  fi
  step rl rl "$OUT/rl" "$CONFIG" "${pin[@]}" > "$OUT/rl.log" 2>&1 & a=$!
  step rl_control rl "$OUT/rl_control" "$CONTROL_CONFIG" "${pin_control[@]}" > "$OUT/rl_control.log" 2>&1 &
  b=$!
  failed=0; wait $a || failed=$?; wait $b || failed=$?
  [[ $failed == 0 ]] || { echo "error: an RL run failed: see $OUT/rl.log and $OUT/rl_control.log" >&2; exit 1; }
else
  step rl rl "$OUT/rl" "$CONFIG"
  step rl_control rl "$OUT/rl_control" "$CONTROL_CONFIG"
fi
step eval_after ev after --lora "$OUT/rl/lora_final"
step eval_control ev control --lora "$OUT/rl_control/lora_final"
step result python -m experiments.mini_edit.result --out "$OUT" \
  --rl-seconds "$(awk '$1 == "rl" {s = $2} END {print s}' "$OUT/timings.txt")"
