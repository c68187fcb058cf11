"""The Qwen-Image-Edit family (`family.py`): Qwen-Image's transformer over target and reference image tokens."""
