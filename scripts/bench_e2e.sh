#!/usr/bin/env bash
# End-to-end `python -m jaxflow.train` at Qwen-Image size with random weights: writes a full-size pipeline folder
# without transformer weights (model.init=random: the trainer and the rollout draw the same 20B weights on their
# GPUs, fingerprint-checked), runs configs/qwen_ocr.py at its own settings (512^2, 10 steps, window 2, CFG 4, LoRA
# r64, 2 updates a step, its micro-batch, old log-probs recomputed, the OCR reward) with only the prompts per step
# cut (PROMPTS, default 2; prompts per rollout call then min(4, PROMPTS / 2): a step keeps two calls or more, so
# one call's reward overlaps the next call's rollout as in the recipe's 8 calls; train.num_micro_batches scaled so
# that a micro-batch keeps the recipe's size, or MICRO samples), 4 steps, no eval or checkpoints; then
# prints img/GPU/s with the phase breakdown and writes OUT_DIR/RESULT.json (with the device's peak memory, read by
# nvidia-smi every 0.5 s).
#
#   [ENGINE=vllm_omni|diffusers] [LAYOUT=1gpu|inproc|2gpu|2gpu_colocated] [SLEEP=false|true] [PROMPTS=2] [MICRO=n] \
#     [PER_CALL=n] [RESULT=name] [PROFILE_STEP=k] bash scripts/bench_e2e.sh OUT_DIR [extra --config overrides]
#
# PER_CALL: prompts per rollout call (default min(4, PROMPTS / 2)); keep it when comparing layouts of different
# PROMPTS, so that every engine's calls are the same size.
#
# Left out, ENGINE and SLEEP are the recipe's. Runs before 2026-11-25 used this script's earlier form (diffusers and
# the in-process layout by default, 8 micro-batches, one prompt per call, the JPEG reward): benchmarks/HISTORY.md
# names the overrides each used.
#
# PROFILE_STEP=k traces step k of the run (the `profile` config section; leave it out of the figures by running
# more steps), dumps the train step's optimized HLO, and prints where its GPU time goes by kernel class, named
# scope and HLO op (scripts/profile_step.py --trace; OUT_DIR/profile_trace.json).
#
# Layouts:
#   inproc  one GPU, the diffusers engine in the trainer's process (no Ray); JAX holds a fixed pool
#   1gpu    one GPU shared by the trainer and a Ray rollout actor (num_gpus=1); JAX holds a fixed pool; with
#           SLEEP=true the engine also sleeps while JAX trains (the freed memory and the wake time are logged)
#   2gpu    two GPUs (CUDA_VISIBLE_DEVICES, default 0,1): a Ray head owning both is started first; the trainer sees
#           only the second and the Ray actor takes the first; trajectories and the LoRA go through Ray every step
#   2gpu_colocated  two GPUs, each as 1gpu: the trainer data-parallel over both (micro-batches per device as on
#           one GPU), one engine on each (rollout.num_servers=2); PROMPTS=4 PER_CALL=1 is 1gpu's PROMPTS=2 per GPU
set -euo pipefail
out=${1:?usage: bench_e2e.sh OUT_DIR [overrides]}; shift
engine=${ENGINE:-vllm_omni} layout=${LAYOUT:-1gpu} prompts=${PROMPTS:-2}
result=${RESULT:-e2e_${engine}_${layout}}
# samples per micro-batch: MICRO, or the recipe's (its sample.prompts_per_step x group_size / mini x micro-batches)
micro=${MICRO:-$(python3 -c "
import importlib.util as u; s = u.spec_from_file_location('r', 'configs/qwen_ocr.py'); m = u.module_from_spec(s)
s.loader.exec_module(m); c = m.get_config(); t = c.train
print(c.sample.prompts_per_step * c.sample.group_size // (t.num_mini_batches * t.num_micro_batches))")}
mini=$(python3 -c "
import importlib.util as u; s = u.spec_from_file_location('r', 'configs/qwen_ocr.py'); m = u.module_from_spec(s)
s.loader.exec_module(m); c = m.get_config(); print(c.train.num_mini_batches, c.sample.group_size)")
read -r mini group <<<"$mini"
per_call=$((prompts / 2 < 4 ? prompts / 2 : 4)); per_call=${PER_CALL:-$((per_call < 1 ? 1 : per_call))}
mkdir -p "$out"   # the whole training log goes to $out/train.log (kept when a time limit cuts the run)
model=${MODEL_DIR:-/tmp/qwen_random}  # written if missing: random weights, a text encoder of the real size
# One process holds JAX and torch, or JAX shares its GPU with the actor: JAX gets a fixed pool (its allocator never
# returns memory). jax >= 0.11 reads XLA_CLIENT_MEM_FRACTION and ignores the GPU if the deprecated
# XLA_PYTHON_CLIENT_MEM_FRACTION is also set.
unset XLA_PYTHON_CLIENT_MEM_FRACTION
given_fraction=${XLA_CLIENT_MEM_FRACTION:+XLA_CLIENT_MEM_FRACTION=$XLA_CLIENT_MEM_FRACTION }  # for the result's command
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-true} PYTHONUNBUFFERED=1
gpus=1 trainer_devices=1
watched=${CUDA_VISIBLE_DEVICES:-}  # the GPUs whose memory the result reports (all when unset)
case $layout in
  inproc) export XLA_CLIENT_MEM_FRACTION=${XLA_CLIENT_MEM_FRACTION:-0.5}
          placement=(--config.rollout.layout=in_process --config.rollout.num_gpus=0) ;;
  1gpu)   # 0.56 of an H200 (78.6 GiB) holds the recipe's update (77.1 GiB at 4 samples per micro-batch) and leaves
          # the engine its 20B weights, the 7B text encoder and its activations
          export XLA_CLIENT_MEM_FRACTION=${XLA_CLIENT_MEM_FRACTION:-0.56}
          placement=(--config.rollout.layout=colocated --config.rollout.num_gpus=1) ;;
  2gpu)   # a Ray head of its own owns the two GPUs (CUDA_VISIBLE_DEVICES, default 0,1) and hands the first to the
          # rollout actor; the trainer process sees only the second. The head has a temp dir of its own and a free
          # port, and only its processes are stopped at the end: other Ray instances on the host are left alone
          pair=${CUDA_VISIBLE_DEVICES:-0,1}
          [[ $pair =~ ^[0-9]+,[0-9]+$ ]] || { echo "LAYOUT=2gpu needs two GPUs: set CUDA_VISIBLE_DEVICES to two ids" \
            "such as 0,1 (it is '$pair')" >&2; exit 2; }
          # no token authentication (ray 2.60's `ray start` turns it on where ~/.ray/auth_token exists, and then
          # refuses a driver without RAY_AUTH_MODE=token); the head's processes outlast SIGTERM: killed 2 s later
          ray_dir=/tmp/ray_e2e_$$; export RAY_AUTH_MODE=disabled
          trap 'pkill -f "$ray_dir" 2>/dev/null; sleep 2; pkill -9 -f "$ray_dir" 2>/dev/null; true' EXIT
          CUDA_VISIBLE_DEVICES=$pair python3 -m ray.scripts.scripts start --head --port=0 --num-gpus=2 \
            --temp-dir="$ray_dir" --disable-usage-stats >"$out/ray_start.log" 2>&1 ||
            { echo "the Ray head did not start: see $out/ray_start.log" >&2; exit 1; }
          address=$(cat "$ray_dir/ray_current_cluster" 2>/dev/null || true)  # ray start writes its address there
          [[ $address =~ :[1-9][0-9]*$ ]] ||
            { echo "no address for the Ray head in $ray_dir: see $out/ray_start.log" >&2; exit 1; }
          export XLA_CLIENT_MEM_FRACTION=${XLA_CLIENT_MEM_FRACTION:-0.9} CUDA_VISIBLE_DEVICES=${pair#*,}; gpus=2
          placement=(--config.rollout.layout=split --config.rollout.num_gpus=1 --config.rollout.address="$address") ;;
  2gpu_colocated)  # both GPUs as 1gpu's one: JAX's pool and an engine on each, the step data-parallel over them
          export XLA_CLIENT_MEM_FRACTION=${XLA_CLIENT_MEM_FRACTION:-0.56}; gpus=2 trainer_devices=2
          placement=(--config.rollout.layout=colocated --config.rollout.num_gpus=1 --config.rollout.num_servers=2) ;;
  *) echo "LAYOUT must be inproc, 1gpu, 2gpu or 2gpu_colocated" >&2; exit 2 ;;
esac
[ "$engine" = vllm_omni ] && [ "$layout" = inproc ] && { echo "the vllm_omni engine runs in a Ray actor: LAYOUT=1gpu or 2gpu" >&2; exit 2; }
python3 -c "import jax; b = jax.default_backend(); assert b == 'gpu', f'JAX runs on {b}, not the GPU'; print(jax.devices())"
[ -f "$model/model_index.json" ] || python3 scripts/make_random_pipeline.py --out "$model" --no-transformer-weights
cmd=(python3 -m jaxflow.train --config configs/qwen_ocr.py --config.model.path="$model" --config.model.init=random
  --config.rollout.engine="$engine" --config.rollout.dtype=bfloat16 --config.rollout.device=cuda
  ${SLEEP:+--config.rollout.sleep_while_training=$SLEEP} "${placement[@]}"
  --config.sample.prompts_per_step="$prompts" --config.sample.prompts_per_call="$per_call"
  --config.train.num_micro_batches=$((prompts * group / mini / micro / trainer_devices)) --config.train.num_steps=4
  --config.eval.every=0
  --config.checkpoint.every=1000 --config.log.progress=False --config.run_dir="$out/run" "$@")
exclude=()
if [ -n "${PROFILE_STEP:-}" ]; then
  cmd+=(--config.profile.start_step="$PROFILE_STEP" --config.profile.num_steps=1)
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$out/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*update.*"
  exclude=(--exclude "$PROFILE_STEP")
fi
nvidia-smi ${watched:+-i "$watched"} --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 >"$out/gpu_mem.csv" 2>/dev/null &
smi=$!
# every line stamped with the time of day, to see where start-up goes
"${cmd[@]}" 2>&1 | while IFS= read -r line; do printf '%(%H:%M:%S)T %s\n' -1 "$line"; done | tee "$out/train.log"
kill "$smi" 2>/dev/null || true
python3 -m jaxflow_bench.summary "$out/run" --gpus "$gpus" --result "$result" --out "$out" "${exclude[@]}" \
  --gpu-mem "$out/gpu_mem.csv" \
  --command "${given_fraction}${MODEL_DIR:+MODEL_DIR=$MODEL_DIR }ENGINE=$engine LAYOUT=$layout ${SLEEP:+SLEEP=$SLEEP }PROMPTS=$prompts ${MICRO:+MICRO=$MICRO }${PER_CALL:+PER_CALL=$PER_CALL }bash scripts/bench_e2e.sh OUT $*"
if [ -n "${PROFILE_STEP:-}" ]; then
  python3 scripts/profile_step.py --out "$out" --trace "$out/run/profile" --hlo "$out/hlo"
fi
