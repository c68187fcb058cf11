"""The benchmarks' shared pieces; the command lines that use them are scripts/*.py (BENCHMARKS.md).

Each module imports only what its concept needs, so a machine with one framework can run its benchmarks:
`results` (result JSON files), `flops` (the model FLOP count), `rollout` (the rollout benchmarks' prompts, settings
and random adapter) and `kernels` (GPU kernel-time breakdowns of profiler traces) import neither JAX nor torch at
import; `timing` (timers, the GEMM ceiling) and `workload` (model sizes, the train step's synthetic batch, random
model and the recipe's step config) are the JAX side's; `torch_step` (the train-step benchmark's torch clipped
objective) is the torch side's.
"""
