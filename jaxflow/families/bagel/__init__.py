"""BAGEL (mixture-of-transformers Qwen2.5) generation path in Flax NNX (docs/bagel.md)."""
