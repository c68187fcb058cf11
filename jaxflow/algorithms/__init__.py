"""The training algorithms (docs/design.md §2)."""
