"""The Qwen-Image family (`family.py`)."""
