#!/usr/bin/env bash
# Stage vLLM-Omni 0.20.0 (+ vllm 0.20.0) and the trainer's missing dependencies (ray, ml-collections, ...) for a
# GPU machine that cannot reach any package index.
#
#   bash launch/stage_vllm_omni.sh            # rerunnable: downloads what is missing, re-splits, prints the plan
#   SET=mini bash launch/stage_vllm_omni.sh   # only what experiments/mini_ocr/run.sh needs (no vllm, no ray): 2 calls
#
# Downloads Python 3.12 manylinux x86_64 wheels (--no-deps; the set that ran on an H200 with torch
# 2.11.0+cu130, see docs/vllm_omni.md) into the ignored folder .stage/wheels, splits the
# big wheels into parts that fit one device call beside the working tree (a call carries at most 64 MiB, the
# tracked files counted as they lie on disk, plus 1 MB of margin; PART_BYTES=N overrides),
# groups everything into .stage/call-N folders (one per device call) and prints the calls to make.
# The last call runs launch/install_staged.sh, which reassembles, checks sha256 and pip-installs into
# /tmp/site. Calls must follow each other while the machine is warm (/tmp survives only that long).
set -euo pipefail
cd "$(dirname "$0")/.."

SET=${SET:-all}
# the tracked files' blocks on disk (0 outside a git checkout, which no device call carries)
TREE_BYTES=$({ git ls-files -z 2>/dev/null || true; } | du -B1 -c --files0-from=- | tail -n 1 | cut -f1)
PART_BYTES=${PART_BYTES:-$((64 * 1024 * 1024 - TREE_BYTES - 1000000))}
# the OCR reward's packages that the device image lacks (it has onnxruntime and opencv-python-headless)
OCR_WHEELS=(rapidocr-onnxruntime==1.4.4 pyclipper==1.4.0 shapely==2.1.2)
TRAINER_WHEELS=(ml-collections==1.1.0 tensorboardX==2.6.5 levenshtein==0.27.5 rapidfuzz==3.14.6)
WHEELS=(
  vllm==0.20.0 vllm-omni==0.20.0 diffusers==0.40.0 cache-dit==1.3.0 peft==0.21.2
  x-transformers==2.31.10 einx==0.4.3 loguru==0.7.3 frozendict==2.5.1 torch-einops-utils==0.2.0
  aenum==3.1.16 apache-tvm-ffi==0.1.9 xgrammar==0.1.32 llguidance==1.3.0 openai==2.8.0 jiter==0.19.0
  openai-harmony==0.0.8 msgspec==0.22.0 pyzmq==27.3.0 pydantic==2.12.5 pydantic-core==2.41.5
  annotated-types==0.8.0 typing-inspection==0.4.5 cachetools==8.0.1 cbor2==6.2.1 distro==1.9.0
  gguf==0.19.0 janus==2.0.0 omegaconf==2.4.0 prettytable==3.18.0 wcwidth==0.9.4 pybase64==1.5.1
  sniffio==1.3.1
  # vLLM's AR engine (BAGEL's two-stage thinker) imports these at its start; the set that got it past its imports
  blake3==1.0.11 diskcache==5.6.3 lark==1.2.2 partial-json-parser==0.2.1.1.post7 depyf==0.20.0 astor==0.8.1
  watchfiles==1.3.0 anyio==4.16.0 python-json-logger==4.2.0 ijson==3.6.0 setproctitle==1.3.8 outlines_core==0.2.14
  lm-format-enforcer==0.11.3 interegular==0.3.3 compressed-tensors==0.15.0.1
  # the trainer's own dependencies that the device image lacks (ray's wheel is over one call: it is split too)
  ray==2.60.0 click==8.3.1 jsonschema==4.25.1 jsonschema-specifications==2025.9.1 referencing==0.37.0
  rpds-py==0.30.0 attrs==25.4.0 msgpack==1.1.2 "${TRAINER_WHEELS[@]}" "${OCR_WHEELS[@]}"
)
case $SET in
  all)  STAGE=.stage ;;
  mini) STAGE=.stage/mini WHEELS=(diffusers==0.40.0 "${TRAINER_WHEELS[@]}" "${OCR_WHEELS[@]}") ;;
  *) echo "SET must be all or mini" >&2; exit 2 ;;
esac
PLATFORMS=(manylinux_2_39_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64
           manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)

download() {
  local args=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
              --abi cp312 --abi abi3 --abi none -d "$STAGE/wheels")
  for p in "${PLATFORMS[@]}"; do args+=(--platform "$p"); done
  python3 -m pip download -q "${args[@]}" "${WHEELS[@]}"
}

split_and_group() {
  rm -rf "$STAGE"/call-* "$STAGE/parts"
  mkdir -p "$STAGE/parts"
  (cd "$STAGE/wheels" && sha256sum ./*.whl > ../SHA256SUMS)
  local big
  for big in $(find "$STAGE/wheels" -name '*.whl' -size +"${PART_BYTES}"c); do
    split -b "$PART_BYTES" -d -a 2 "$big" "$STAGE/parts/$(basename "$big").part-"
  done
  # first-fit decreasing: parts and wheels into as few calls of <= PART_BYTES as fit
  python3 - "$STAGE" "$PART_BYTES" <<'PY'
import os, sys
stage, budget = sys.argv[1], int(sys.argv[2])
items = [os.path.join(stage, "parts", f) for f in os.listdir(os.path.join(stage, "parts"))]
items += [os.path.join(stage, "wheels", f) for f in os.listdir(os.path.join(stage, "wheels"))
          if os.path.getsize(os.path.join(stage, "wheels", f)) <= budget]
items.append(os.path.join(stage, "SHA256SUMS"))
calls = []
for item in sorted(items, key=os.path.getsize, reverse=True):
    size = os.path.getsize(item)
    call = next((c for c in calls if c[0] + size <= budget), None)
    if call is None:
        call = [0, []]
        calls.append(call)
    call[0] += size
    call[1].append(item)
for i, (_, files) in enumerate(calls, 1):
    os.makedirs(os.path.join(stage, f"call-{i}"))
    for f in files:
        os.link(f, os.path.join(stage, f"call-{i}", os.path.basename(f)))
print(len(calls))
PY
}

print_plan() {
  local calls=$1 i
  echo
  echo "== staged: $(du -sh "$STAGE/wheels" | cut -f1) of wheels in $calls device calls =="
  for i in $(seq 1 "$calls"); do
    echo "  call-$i: $(du -sh "$STAGE/call-$i" | cut -f1) ($(ls "$STAGE/call-$i" | wc -l) files)"
  done
  echo
  echo "== plan: device 'run' calls in a row, each within the warm window of the last =="
  for i in $(seq 1 $((calls - 1))); do
    echo "  run(carry=[\"$STAGE/call-$i\"], command=\"mkdir -p /tmp/stage && cp $STAGE/call-$i/* /tmp/stage/\")"
  done
  echo "  run(carry=[\"$STAGE/call-$calls\"], command=\"mkdir -p /tmp/stage && cp $STAGE/call-$calls/* /tmp/stage/" \
       "&& bash launch/install_staged.sh /tmp/stage /tmp/site\")"
  echo
  echo "== then, in every later call of that warm machine =="
  local probe=vllm_omni
  [ "$SET" = mini ] && probe=diffusers
  echo "  export PYTHONPATH=/tmp/site:\$PWD;" \
       "test -d /tmp/site/$probe || { echo 'machine went cold: stage again'; exit 1; }"
}

mkdir -p "$STAGE/wheels"
download
print_plan "$(split_and_group)"
