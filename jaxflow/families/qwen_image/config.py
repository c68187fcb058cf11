"""Qwen-Image's transformer configuration: diffusers' config.json keys of `QwenImageTransformer2DModel`."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

# Keys diffusers writes for QwenImageTransformer2DModel that we read; all others are rejected or ignored (below).
_IGNORED_KEYS = {"_class_name", "_diffusers_version", "_name_or_path", "pooled_projection_dim"}
_UNSUPPORTED_TRUE = ("guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope")


@dataclasses.dataclass(frozen=True)
class QwenImageConfig:
    """Same keys and defaults as diffusers' `QwenImageTransformer2DModel` (the released Qwen-Image)."""

    patch_size: int = 2
    in_channels: int = 64
    out_channels: int = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    zero_cond_t: bool = False
    use_additional_t_cond: bool = False
    use_layer3d_rope: bool = False

    def __post_init__(self):
        object.__setattr__(self, "axes_dims_rope", tuple(int(a) for a in self.axes_dims_rope))
        self.validate()

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_dim(self) -> int:
        return 4 * self.inner_dim

    def validate(self) -> None:
        """Reject configurations the model cannot compute, naming the offending key."""
        if len(self.axes_dims_rope) != 3:
            raise ValueError(f"axes_dims_rope must have 3 entries (frame, height, width), got {self.axes_dims_rope}")
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(
                f"axes_dims_rope {self.axes_dims_rope} sums to {sum(self.axes_dims_rope)} but attention_head_dim is "
                f"{self.attention_head_dim}: sum(axes_dims_rope) must equal attention_head_dim")
        if any(a % 2 for a in self.axes_dims_rope):
            raise ValueError(f"axes_dims_rope {self.axes_dims_rope}: every axis dim must be even (RoPE uses pairs)")
        if self.patch_size ** 2 * self.out_channels != self.in_channels:
            raise ValueError(
                f"patch_size**2 * out_channels = {self.patch_size ** 2 * self.out_channels} must equal in_channels = "
                f"{self.in_channels} (the pipeline packs 2x2 patches of out_channels latents)")
        for key in ("num_layers", "attention_head_dim", "num_attention_heads", "joint_attention_dim"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        for key in _UNSUPPORTED_TRUE:
            if getattr(self, key):
                raise ValueError(f"{key}=True is not supported by jaxflow's Qwen-Image text-to-image model")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "QwenImageConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields - _IGNORED_KEYS)
        if unknown:
            raise ValueError(f"unknown Qwen-Image transformer config keys: {unknown}")
        return cls(**{k: v for k, v in d.items() if k in fields})

    @classmethod
    def from_json(cls, path: str | Path) -> "QwenImageConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["axes_dims_rope"] = list(self.axes_dims_rope)
        return {"_class_name": "QwenImageTransformer2DModel", **d}
