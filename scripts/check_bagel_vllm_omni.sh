#!/usr/bin/env bash
# BAGEL on the vllm_omni engine, on one GPU (docs/bagel.md §7 (d), (f)), in one run on the tiny random BAGEL:
#   the folder saved in bf16 (vLLM-Omni runs bf16 folders; cached under $JAXFLOW_CACHE or ~/.cache/jaxflow),
#   the engine started on it and sampled without and with a LoRA (scripts/check_bagel_engine.py: one stage, same seeds
#   same bytes, every adapter module bound, the in-place slot write equal to vLLM-Omni's own folder load), then
#   rollout vs trainer log-prob parity (scripts/verify_logprob_parity.py --model-family bagel --engine vllm_omni
#   --dtype bfloat16) with CFG 4, CFG 1, CFG 4 with a rank-8 LoRA, CFG 4 with the trainer in float32, and CFG 4 in
#   think mode (a greedy decode of at most 24 tokens extends each prompt's context: --think 24); then CFG 4 without and
#   with the rank-8 LoRA in vLLM-Omni's two-stage deployment (--deploy two_stage: the thinker, then the DiT stage).
#   bash scripts/check_bagel_vllm_omni.sh OUT_DIR      (needs vLLM-Omni 0.20: launch/stage_vllm_omni.sh on machines
#                                                       without a package index)
#   CASES="cfg4_lora8 two_stage_cfg4_lora8" bash scripts/check_bagel_vllm_omni.sh OUT_DIR   (the engine and these
#                                                       parity cases only; the figures of the others are left null)
# Writes OUT_DIR/engine.{log,json}, OUT_DIR/CASE.{log,json} per parity case and OUT_DIR/parity_bagel.json (figures:
# max / p99 |dlogp| per case, the engine checks); prints a short table last.
set -uo pipefail
out=${1:?usage: check_bagel_vllm_omni.sh OUT_DIR}
ALL="cfg4_lora8 cfg4_jax_fp32 cfg4 cfg1 cfg4_think two_stage_cfg4 two_stage_cfg4_lora8"
for name in ${CASES:-}; do
  [[ " $ALL " == *" $name "* ]] || { echo "error: unknown case '$name' in CASES; cases: $ALL" >&2; exit 2; }
done
mkdir -p "$out"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1  # JAX and torch share the GPU
unset XLA_PYTHON_CLIENT_MEM_FRACTION
folder=$(python3 -c 'from jaxflow_bridge.families.bagel.tiny import tiny_bagel_path; print(tiny_bagel_path(dtype="bfloat16"))') \
  || { echo "could not write the tiny BAGEL folder"; exit 1; }
echo "== tiny BAGEL, bf16: $folder"
echo "== engine: scripts/check_bagel_engine.py"
python3 scripts/check_bagel_engine.py --model "$folder" --json "$out/engine.json" > "$out/engine.log" 2>&1
echo "   exit $?: $(grep -E '^(PASS|FAIL)' "$out/engine.log" || tail -n 3 "$out/engine.log")"
run() {  # NAME ARGS...: one parity run, its table in OUT_DIR/NAME.log, its report in OUT_DIR/NAME.json
  local name=$1; shift
  [[ -z "${CASES:-}" || " $CASES " == *" $name "* ]] || return 0
  echo "== $name: $*"
  python3 scripts/verify_logprob_parity.py --model-family bagel --engine vllm_omni --dtype bfloat16 \
    --model "$folder" --json "$out/$name.json" "$@" > "$out/$name.log" 2>&1
  echo "   exit $?: $(grep -E '^(PASS|FAIL)' "$out/$name.log" || tail -n 3 "$out/$name.log")"
}
run cfg4_lora8 --cfg 4 --lora-rank 8
run cfg4_jax_fp32 --cfg 4 --jax-dtype float32
run cfg4 --cfg 4
run cfg1 --cfg 1
run cfg4_think --cfg 4 --think 24
# vLLM-Omni's two-stage deployment (deploy/bagel.yaml: the thinker prefills, the DiT stage denoises), last: it is the
# newest path, and a thinker that fails to start must not cost the cases above
run two_stage_cfg4 --cfg 4 --deploy two_stage
run two_stage_cfg4_lora8 --cfg 4 --lora-rank 8 --deploy two_stage
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
from jaxflow_bench.results import write_result
out = Path(sys.argv[1])
def report(name):
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None
cases = ("cfg4_lora8", "cfg4_jax_fp32", "cfg4", "cfg1", "cfg4_think", "two_stage_cfg4", "two_stage_cfg4_lora8")
engine = report("engine") or {"checks": {}, "figures": {}, "passed": False}
figures = {"engine_checks_passed": sum(bool(v) for v in engine["checks"].values()),
           "engine_checks": len(engine["checks"]), "engine_start_s": engine["figures"].get("engine_start_s"),
           "generate_s": engine["figures"].get("generate_s")}
for name in cases:
    r = report(name)
    figures.update({f"max_{name}": r and r["overall"]["max"], f"p99_{name}": r and r["overall"]["p99"],
                    f"passed_{name}": r and r["passed"]})
write_result(out, "parity_bagel", figures, command="bash scripts/check_bagel_vllm_omni.sh OUT",
             extra={"engine_checks": engine["checks"]})
print(f"\n{'check':<16s} {'max |dlogp|':>12s} {'p99 |dlogp|':>12s}  result")
print(f"{'engine':<16s} {'':>12s} {'':>12s}  {figures['engine_checks_passed']}/{figures['engine_checks']} "
      f"{'PASS' if engine['passed'] else 'FAIL'}")
for name in cases:
    r = report(name)
    if r is None:
        print(f"{name:<16s} {'-':>12s} {'-':>12s}  no report (see {name}.log)")
    else:
        print(f"{name:<16s} {r['overall']['max']:12.3e} {r['overall']['p99']:12.3e}  "
              f"{'PASS' if r['passed'] else 'FAIL'} (threshold {r['args']['threshold']:.0e})")
PY
