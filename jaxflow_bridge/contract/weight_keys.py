"""One entry of a declarative weight-key map (each family's keymap.py): a Flax leaf's path and the checkpoint
tensor name(s) it holds. Pure Python (no jax/torch import)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Entry:
    """One Flax leaf <-> one diffusers tensor (or one per layer when `stacked`)."""

    flax_path: tuple[str, ...]
    diffusers_key: str          # contains "{i}" when stacked
    transpose: bool
    stacked: bool

    def diffusers_keys(self, num_layers: int) -> list[str]:
        if not self.stacked:
            return [self.diffusers_key]
        return [self.diffusers_key.format(i=i) for i in range(num_layers)]

    def torch_shape(self, flax_shape) -> tuple[int, ...]:
        """The shape of each of its diffusers tensors, given the Flax leaf's (layers first when `stacked`)."""
        per_layer = tuple(flax_shape[1:] if self.stacked else flax_shape)
        return per_layer[::-1] if self.transpose else per_layer
