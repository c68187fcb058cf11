"""The contract both sides share, numpy and plain Python only (no JAX, no torch, no jaxflow): the sigma schedule and
SDE windows, the Trajectory batch, the random-weights spec, PEFT adapter folders and LoRA names, the weight-key map,
and the safetensors codec. The trainer (jaxflow) and the rollout (jaxflow_bridge.rollout) both import it."""
