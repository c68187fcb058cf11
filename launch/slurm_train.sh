#!/usr/bin/env bash
# SLURM launcher: a Ray cluster over the allocation (head on the first node, workers on the rest) for the rollout
# servers, and the JAX trainer as one process per node (jax.distributed) on every node's GPUs.
#
#   sbatch --nodes=2 --gpus-per-node=8 launch/slurm_train.sh configs/qwen_ocr.py --config.model.path=/models/Qwen-Image
#
# Rollout servers are placed by Ray (config.rollout.num_servers, num_gpus each). The trainer runs as
# $SLURM_NNODES JAX processes (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, read by
# jaxflow.trainer.sharding.maybe_initialize_distributed); its mesh (config.sharding) covers the GPUs of all nodes. Process 0
# (on the head node) is the only rollout/reward driver and ships each step's batch to the others; the global batch
# (sample.prompts_per_step x sample.group_size) must divide by the number of nodes. config.run_dir must be on a
# filesystem every node shares (checkpoints are written by all processes). Leave GPUs free for both: the trainer
# uses what Ray's rollout servers do not (set config.rollout.num_gpus / CUDA_VISIBLE_DEVICES accordingly).
#SBATCH --job-name=jaxflow
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail
config=${1:?usage: slurm_train.sh CONFIG [--config.x=y ...]}; shift
nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
head=${nodes[0]}
port=${RAY_PORT:-6379}
jax_port=${JAX_PORT:-6380}
head_ip=$(srun --nodes=1 --ntasks=1 -w "$head" hostname --ip-address | awk '{print $1}')
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # JAX's share of each GPU: the run's plan (jaxflow/config/machine.py)
# Ray's token authentication, the default of `ray start --head`, on every node and for the trainer alike (the token
# the head writes to ~/.ray/auth_token must reach every node: a shared home, or RAY_AUTH_TOKEN in the environment)
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}

# RAY_START_ARGS: extra `ray start` options for every node (e.g. --num-cpus=16 --num-gpus=4; head-only options such
# as --include-dashboard are refused on the others)
srun --nodes=1 --ntasks=1 -w "$head" ray start --head --node-ip-address="$head_ip" --port="$port" ${RAY_START_ARGS:-} \
  --block &
sleep 10
for node in "${nodes[@]:1}"; do
  srun --nodes=1 --ntasks=1 -w "$node" ray start --address="$head_ip:$port" ${RAY_START_ARGS:-} --block &
done
sleep 10
# One trainer task per node; SLURM_NODEID is the JAX process id (node 0 = the head = the driver).
export JAX_COORDINATOR_ADDRESS="$head_ip:$jax_port" JAX_NUM_PROCESSES="$SLURM_NNODES"
srun --nodes="$SLURM_NNODES" --ntasks="$SLURM_NNODES" --ntasks-per-node=1 --overlap \
  bash -c 'JAX_PROCESS_ID=$SLURM_NODEID exec python -m jaxflow.train "$@"' jaxflow-train \
  --config "$config" --config.rollout.address="$head_ip:$port" "$@"
