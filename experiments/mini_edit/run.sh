#!/usr/bin/env bash
# The mini edit proof, planned after experiments/mini_ocr/run.sh: a tiny Qwen-Image-Edit-shaped model pretrained to
# edit sign text, then FlowGRPO (or NFT) with the edit_ocr reward must raise held-out edit-OCR by >= 0.2 within one
# 10-minute run on one GPU, beside a shuffled-reward control that does not rise.
#
#   bash experiments/mini_edit/run.sh OUT                  # every step implemented so far
#   SMOKE=1 bash experiments/mini_edit/run.sh /tmp/edit     # the same at toy size
#   ONLY="data" bash experiments/mini_edit/run.sh OUT       # only these steps
#
# Steps (mini_ocr's pieces reused where they fit):
#   data        implemented: sign edits (experiments/mini_edit/signs.py) over mini_ocr's disjoint word split,
#               OUT/data/{train,test}.jsonl + images (the RL and eval prompts, the edit JSONL format) and
#               OUT/data/pairs.npz (the train split's source and edited signs and instructions: the pretraining feed).
#   vae         not yet: mini_ocr's `prepare vae` as is (the same renderer, so the same sign VAE), trained on
#               pairs.npz's sources and edits instead of images.npy.
#   encode      not yet: the packed VAE means of sources and edits, and the instructions' text embeddings
#               (mini_ocr's `prepare encode` over two image sets).
#   pretrain    not yet: mini_ocr's flow-matching pretrain with the edit family's conditioning (the source's
#               latent tokens beside the noisy target's, as Qwen-Image-Edit takes them); needs the qwen_image_edit
#               family's Flax model and its tiny folder builder.
#   eval_before, eval_after
#               not yet: edit_ocr (jaxflow_bridge/rewards/edit_ocr.py) of ODE edits of the held-out signs
#               (mini_ocr's evaluate.py with sources and targets passed to the reward).
#   rl, rl_control
#               not yet: python -m jaxflow.train with a configs/mini_edit.py (mini_ocr's RL recipe, the edit family,
#               reward edit_ocr; the control an "edit_ocr_shuffled", Shuffled over EditOcrReward, which needs
#               Shuffled to pass sources and targets through).
#   result      not yet: mini_ocr's result.py over the edit evals.
set -euo pipefail
OUT=${1:?usage: [SMOKE=1] [ONLY="data ..."] bash experiments/mini_edit/run.sh OUT}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export HF_HUB_OFFLINE=1

if [[ "${SMOKE:-0}" == 1 ]]; then
  DATA=(--train 64 --test 16)
else
  DATA=(--train 4000 --test 200)
fi
IMPLEMENTED="data"
PLANNED="vae encode pretrain eval_before rl rl_control eval_after result"

for step in ${ONLY:-$IMPLEMENTED}; do
  case "$step" in
    data) python -m experiments.mini_edit.signs --out "$OUT/data" "${DATA[@]}" --pairs ;;
    *)
      if [[ " $PLANNED " == *" $step "* ]]; then
        echo "error: mini_edit step '$step' is not implemented yet (experiments/mini_edit/run.sh lists what it needs); run ONLY=\"$IMPLEMENTED\"" >&2
      else
        echo "error: unknown mini_edit step '$step'; steps: $IMPLEMENTED $PLANNED" >&2
      fi
      exit 2 ;;
  esac
done
