#!/usr/bin/env bash
# Log-prob parity on a GPU, every engine and precision the project claims, in one run (tiny offline pipeline):
#   float32 diffusers (CFG 4; JAX at matmul precision "highest" with XLA attention, chosen by ModelOptions),
#   bfloat16 diffusers (CFG 4, LoRA r8), bfloat16 vLLM-Omni (CFG 4 and CFG 1, LoRA r8; CFG 4 as the recipe runs it,
#   two forwards, and also in one padded forward: --cfg-forward batched), and vLLM-Omni CFG 4 with the JAX side's
#   RoPE tables rounded to bf16 as vLLM-Omni rounds them (how much of the mismatch they explain).
#   bash scripts/gpu_parity_suite.sh OUT_DIR        (needs vLLM-Omni: launch/stage_vllm_omni.sh on machines
#                                                    without a package index)
# Writes OUT_DIR/parity_gpu.json and OUT_DIR/parity_vllm_omni.json (figures: max / p99 |dlogp|).
set -uo pipefail
out=${1:?usage: gpu_parity_suite.sh OUT_DIR}
mkdir -p "$out"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1  # JAX and torch share the GPU in one process
unset XLA_PYTHON_CLIENT_MEM_FRACTION
run() {  # NAME ARGS...: one parity run, its table in OUT_DIR/NAME.log, its report in OUT_DIR/NAME.json
  local name=$1; shift
  echo "== $name: $*"
  python3 scripts/verify_logprob_parity.py --json "$out/$name.json" "$@" > "$out/$name.log" 2>&1
  echo "   exit $?: $(grep -E '^(PASS|FAIL)' "$out/$name.log" || tail -n 3 "$out/$name.log")"
}
run fp32_diffusers --engine diffusers --dtype float32 --cfg 4
run bf16_diffusers --engine diffusers --dtype bfloat16 --cfg 4 --lora-rank 8
run bf16_omni_cfg4 --engine vllm_omni --dtype bfloat16 --cfg 4 --lora-rank 8
run bf16_omni_cfg4_batched --engine vllm_omni --dtype bfloat16 --cfg 4 --lora-rank 8 --cfg-forward batched
run bf16_omni_cfg1 --engine vllm_omni --dtype bfloat16 --cfg 1 --lora-rank 8
run bf16_omni_cfg4_rope --engine vllm_omni --dtype bfloat16 --cfg 4 --lora-rank 8 --jax-rope bfloat16
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
from jaxflow_bench.results import write_result
out = Path(sys.argv[1])
def stat(name, key):
    path = out / f"{name}.json"
    return json.loads(path.read_text())["overall"][key] if path.exists() else None
cmd = "bash scripts/gpu_parity_suite.sh OUT"
write_result(out, "parity_gpu", {"fp32_max": stat("fp32_diffusers", "max"), "fp32_p99": stat("fp32_diffusers", "p99"),
                                 "diffusers_p99_cfg4": stat("bf16_diffusers", "p99"),
                                 "diffusers_max_cfg4": stat("bf16_diffusers", "max")}, command=cmd)
write_result(out, "parity_vllm_omni", {"p99_cfg4": stat("bf16_omni_cfg4", "p99"), "max_cfg4": stat("bf16_omni_cfg4", "max"),
                                       "p99_cfg4_batched": stat("bf16_omni_cfg4_batched", "p99"),
                                       "max_cfg4_batched": stat("bf16_omni_cfg4_batched", "max"),
                                       "p99_cfg1": stat("bf16_omni_cfg1", "p99"), "max_cfg1": stat("bf16_omni_cfg1", "max"),
                                       "p99_cfg4_jax_bf16_rope": stat("bf16_omni_cfg4_rope", "p99"),
                                       "max_cfg4_jax_bf16_rope": stat("bf16_omni_cfg4_rope", "max")}, command=cmd)
for f in ("parity_gpu", "parity_vllm_omni"):
    print(f, json.loads((out / f"{f}.json").read_text())["figures"])
PY
