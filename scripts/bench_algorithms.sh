#!/usr/bin/env bash
# The recipe end to end on one GPU (bench_e2e.sh, random full-size weights, its batch and micro-batch) for each
# algorithm arm: FlowGRPO as shipped, GRPO-Guard's ratio, rollout correction instead of the recompute pass, and
# DiffusionNFT (CFG-free, deterministic rollout, its default timesteps); each arm writes OUT_DIR/ARM/e2e_alg_ARM.json,
# then OUT_DIR/e2e_algorithms.json holds every arm's step time, phases and img/GPU/s side by side (with each arm's
# step time over FlowGRPO's, when both ran). One arm a call fits the device tool's 10 minutes: ARMS="nft".
#
#   [ARMS="flowgrpo guard corrected nft"] [PROMPTS=2] bash scripts/bench_algorithms.sh OUT_DIR [overrides]
set -euo pipefail
out=${1:?usage: bench_algorithms.sh OUT_DIR [overrides]}; shift
for arm in ${ARMS:-flowgrpo guard corrected nft}; do
  case $arm in
    flowgrpo)  extra=() ;;
    guard)     extra=(--config.train.ratio_norm=guard) ;;
    corrected) extra=(--config.train.old_log_prob=rollout_corrected) ;;
    nft)       extra=(--config.train.algorithm=nft --config.sample.guidance=1 --config.sample.sde_type=ode) ;;
    *) echo "unknown arm $arm: choose flowgrpo, guard, corrected or nft" >&2; exit 2 ;;
  esac
  RESULT=e2e_alg_$arm bash scripts/bench_e2e.sh "$out/$arm" "${extra[@]}" "$@"
done
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
from jaxflow_bench.results import write_result
out = Path(sys.argv[1])
arms = {p.parent.name: json.loads(p.read_text()) for p in sorted(out.glob("*/e2e_alg_*.json"))}
figures = {f"{arm}/{k}": v for arm, r in arms.items() for k, v in r["figures"].items()}
base = arms.get("flowgrpo", {}).get("figures", {}).get("step_s")
for arm, r in arms.items():
    if base and arm != "flowgrpo" and r["figures"].get("step_s"):
        figures[f"{arm}/step_vs_flowgrpo"] = r["figures"]["step_s"] / base
write_result(out, "e2e_algorithms", figures, command=f"bash scripts/bench_algorithms.sh OUT ({' '.join(arms)})")
PY
