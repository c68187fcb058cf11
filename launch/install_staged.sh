#!/usr/bin/env bash
# On the device machine: reassemble the staged wheels, check them, install them into a target folder.
#
#   bash launch/install_staged.sh /tmp/stage /tmp/site && export PYTHONPATH=/tmp/site:$PWD
#
# /tmp/stage holds what the calls printed by launch/stage_vllm_omni.sh copied there: wheels, `*.whl.part-NN`
# pieces and SHA256SUMS (of the whole wheels). Nothing is fetched: pip runs with --no-index --no-deps.
set -euo pipefail
STAGE=${1:?usage: install_staged.sh STAGE_DIR TARGET_DIR}
TARGET=${2:?usage: install_staged.sh STAGE_DIR TARGET_DIR}
cd "$STAGE"

for first in *.whl.part-00; do
  [ -e "$first" ] || continue
  wheel=${first%.part-00}
  cat "$wheel".part-* > "$wheel"
  rm "$wheel".part-*
done
sha256sum --quiet -c SHA256SUMS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$TARGET" ./*.whl
echo "installed $(ls ./*.whl | wc -l) wheels into $TARGET"
# pip ran --no-compile: byte-compile the site once here, in parallel, so that the engine's processes (the actor and
# each worker vLLM-Omni spawns, which imports torch, vLLM and vLLM-Omni again) do not compile them at every import;
# a file that does not compile (a template, an optional backend's) is imported from source as before
python3 -m compileall -q -j0 "$TARGET" >/dev/null || echo "compileall: some files in $TARGET were left uncompiled"
