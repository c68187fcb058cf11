"""The family-free Flax pieces every model family builds on: attention, layers, LoRA (its variable type, spec base
and PEFT conversion), the fused LoRA GEMM, run options, checkpoint tensors and the shared random init."""
