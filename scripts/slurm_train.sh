#!/usr/bin/env bash
# SLURM launcher: a Ray cluster over the allocation (head on the first node, workers on the rest) for the rollout
# servers, and the JAX trainer on the head node using that node's GPUs.
#
#   sbatch --nodes=2 --gpus-per-node=8 scripts/slurm_train.sh configs/qwen_ocr.py --config.model.path=/models/Qwen-Image
#
# Rollout servers are placed by Ray (config.rollout.num_servers, num_gpus each); the trainer's mesh covers the
# head node's GPUs (config.sharding). One trainer process: the loop does not yet run across several JAX hosts.
#SBATCH --job-name=jaxflow
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail
config=${1:?usage: slurm_train.sh CONFIG [--config.x=y ...]}; shift
nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
head=${nodes[0]}
port=${RAY_PORT:-6379}
head_ip=$(srun --nodes=1 --ntasks=1 -w "$head" hostname --ip-address | awk '{print $1}')
export XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}

srun --nodes=1 --ntasks=1 -w "$head" ray start --head --node-ip-address="$head_ip" --port="$port" --block &
sleep 10
for node in "${nodes[@]:1}"; do
  srun --nodes=1 --ntasks=1 -w "$node" ray start --address="$head_ip:$port" --block &
done
sleep 10
srun --nodes=1 --ntasks=1 -w "$head" --overlap \
  python -m jaxflow.train --config "$config" --config.rollout.address="$head_ip:$port" "$@"
