"""The training config: every key and the recipes (recipes.py), and its validation (validation.py)."""
