"""Flax Qwen-Image DiT, LoRA and diffusers-checkpoint loading."""
