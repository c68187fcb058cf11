#!/usr/bin/env bash
# Run the trainer against an existing Ray cluster (rollout servers go wherever Ray has GPUs).
#
#   RAY_ADDRESS=10.0.0.1:6379 launch/ray_train.sh configs/qwen_ocr.py --config.model.path=/models/Qwen-Image
#   ray job submit --address http://10.0.0.1:8265 --working-dir . -- bash launch/ray_train.sh configs/qwen_ocr.py ...
set -euo pipefail
config=${1:?usage: ray_train.sh CONFIG [--config.x=y ...]}; shift
# JAX's share of each GPU comes from the run's plan (`python -m jaxflow.plan`), set before JAX starts; an
# XLA_PYTHON_CLIENT_MEM_FRACTION or XLA_CLIENT_MEM_FRACTION in the environment wins
# Ray 2.60's token authentication is the cluster's choice: export RAY_AUTH_MODE=token here exactly when the cluster
# was started with it (the token in ~/.ray/auth_token or RAY_AUTH_TOKEN); a plain `ray start --head` has none.
exec python -m jaxflow.train --config "$config" --config.rollout.address="${RAY_ADDRESS:-auto}" "$@"
