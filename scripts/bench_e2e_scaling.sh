#!/usr/bin/env bash
# The recipe (bench_e2e.sh: configs/qwen_ocr.py, vLLM-Omni, random full-size weights) on one GPU and on two, back to
# back on one 2-GPU host, into OUT_DIR/e2e_2gpu.json (figures img_per_gpu_s, scaling_vs_1gpu and layout of the better
# 2-GPU layout, and each layout's; `jaxflow_bench.results.scaling_figures`). Every run has the same work per GPU: one
# prompt (16 images) a rollout call, 2 prompts a step per GPU, the recipe's micro-batch per device.
#
#   [LAYOUTS="2gpu_colocated 2gpu"] bash scripts/bench_e2e_scaling.sh OUT_DIR [extra --config overrides]
#
# 1gpu: GPU 0 alone (CUDA_VISIBLE_DEVICES=0). 2gpu_colocated: both GPUs as 1gpu's one, the trainer data-parallel over
# them, one engine on each (PROMPTS=4). 2gpu: the split layout, the trainer on one GPU and the engine on the other,
# with rollout.overlap (the next step's rollout runs during this step's training; PROMPTS=4).
#
# 2gpu_colocated runs COLOCATED_MICRO (2) samples a micro-batch in a JAX pool of COLOCATED_POOL (0.5) of each GPU: on
# two H200s (2026-11-26) the 1gpu settings (4 samples, pool 0.56) left NCCL's buffers no room beside the engine (out of
# memory at the first collective, 0.6 GiB free), and at pool 0.55 the update (36.3 GiB with the recipe's
# xla_options, 50.5 before) left 0.8 GiB to spare and could not be placed; at 2 samples a pool of 0.5 holds the update
# and leaves ~8 GiB more outside it (the fused kernel with those text rows, 2 x 96, padded to 256: 132.7 GiB peak a GPU,
# 1.89x one GPU, 2026-11-27; XLA's linears in a scan, 2026-11-26: 1.77x).
set -euo pipefail
out=${1:?usage: bench_e2e_scaling.sh OUT_DIR [overrides]}; shift
# a layout's figure is kept when OUT_DIR already holds it (measured earlier on the same host, same code, same
# overrides; so layouts can run side by side on the GPUs of one larger host, as bench_e2e.sh runs, then be put together)
[ -f "$out/1gpu/e2e_1gpu.json" ] ||
  CUDA_VISIBLE_DEVICES=0 LAYOUT=1gpu PROMPTS=2 PER_CALL=1 RESULT=e2e_1gpu bash scripts/bench_e2e.sh "$out/1gpu" "$@"
layouts=${LAYOUTS:-2gpu_colocated 2gpu} results=()
for layout in $layouts; do
  case $layout in  # each layout's result file: OUT_DIR/LAYOUT/RESULT.json (e2e_2gpu.json is the comparison's)
    2gpu_colocated) result=e2e_2gpu_colocated extra=()
                    envs=(MICRO="${COLOCATED_MICRO:-2}" XLA_CLIENT_MEM_FRACTION="${COLOCATED_POOL:-0.5}") ;;
    2gpu) result=e2e_2gpu_split extra=(--config.rollout.overlap=True) envs=() ;;
    *) echo "LAYOUTS: unknown layout $layout; choose from 2gpu_colocated 2gpu" >&2; exit 2 ;;
  esac
  results+=("$layout/$result.json")
  [ -f "$out/$layout/$result.json" ] ||
    env "${envs[@]}" LAYOUT="$layout" PROMPTS=4 PER_CALL=1 RESULT="$result" \
      bash scripts/bench_e2e.sh "$out/$layout" "${extra[@]}" "$@"
done
python3 - "$out" "${results[@]}" <<'PY'
import json, sys
from pathlib import Path
from jaxflow_bench.results import scaling_figures, write_result
out = Path(sys.argv[1])
figures = lambda path: json.loads(path.read_text())["figures"]  # noqa: E731
layouts = {Path(r).parent.name: figures(out / r) for r in sys.argv[2:]}  # LAYOUT/RESULT.json
result = scaling_figures(figures(out / "1gpu" / "e2e_1gpu.json"), layouts)
write_result(out, "e2e_2gpu", result, command=f"LAYOUTS=\"{' '.join(layouts)}\" bash scripts/bench_e2e_scaling.sh OUT")
print(json.dumps(result, indent=1))
PY
