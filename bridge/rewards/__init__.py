"""Reward models in torch (transformers), loaded from local checkpoint folders; never imports JAX."""
