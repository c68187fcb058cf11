"""The benchmarks' shared pieces; the command lines that use them are scripts/*.py (BENCHMARKS.md).

Each module imports only what its concept needs, so a machine with one framework can run its benchmarks:
`results` (result JSON files), `flops` (the model FLOP count) and `rollout` (the rollout benchmarks' prompts, settings
and random adapter) import neither JAX nor torch; `timing` (timers, the GEMM ceiling) and `workload` (model sizes, the
train step's synthetic batch and random model) are the JAX side's.
"""
