"""BAGEL's geometry: the keys of its `llm_config.json` and `config.json` that the generation path reads."""
from __future__ import annotations

import dataclasses
from typing import Any

# llm_config.json values the model implements (anything else is refused by name).
_REQUIRED = {"hidden_act": "silu"}


@dataclasses.dataclass(frozen=True)
class BagelConfig:
    """Defaults: BAGEL-7B-MoT (Qwen2.5-7B with both experts, docs/bagel.md §1)."""

    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    vocab_size: int = 152064
    latent_patch_size: int = 2
    z_channels: int = 16          # vae_config.z_channels
    max_latent_size: int = 64     # latent_pos_embed holds max_latent_size**2 rows
    # the tokenizer's <|vision_start|> / <|vision_end|> (Qwen2.5's ids), the markers framing the latents
    vision_start_id: int = 151652
    vision_end_id: int = 151653

    def __post_init__(self):
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "vocab_size", "latent_patch_size", "z_channels", "max_latent_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"BagelConfig.{key} must be >= 1, got {getattr(self, key)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                             f"{self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads} (GQA)")
        if self.head_dim % 2 or self.hidden_size % 4:
            raise ValueError(f"head_dim {self.head_dim} must be even (RoPE halves) and hidden_size {self.hidden_size} "
                             f"a multiple of 4 (the 2-D sin-cos table)")
        for key in ("vision_start_id", "vision_end_id"):
            if not 0 <= getattr(self, key) < self.vocab_size:
                raise ValueError(f"BagelConfig.{key}={getattr(self, key)} outside the vocabulary ({self.vocab_size})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def latent_dim(self) -> int:
        """Values per latent token: a latent_patch_size^2 patch of z_channels (64 for BAGEL)."""
        return self.latent_patch_size ** 2 * self.z_channels

    @classmethod
    def from_dicts(cls, llm_config: dict[str, Any], config: dict[str, Any], **token_ids: int) -> "BagelConfig":
        """From the checkpoint's llm_config.json and config.json (token ids from the tokenizer, if not Qwen2.5's)."""
        for key, value in _REQUIRED.items():
            if llm_config.get(key, value) != value:
                raise ValueError(f"llm_config {key}={llm_config[key]!r}; BAGEL's generation path needs {value!r}")
        llm = {f: llm_config[f] for f in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                          "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                                          "rope_theta", "vocab_size")}
        return cls(**llm, latent_patch_size=config["latent_patch_size"], z_channels=config["vae_config"]["z_channels"],
                   max_latent_size=config["max_latent_size"], **token_ids)


# The tiny random BAGEL of docs/bagel.md §6 (markers: the last two ids of its 384-token vocabulary).
TINY = BagelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=384, max_latent_size=32, vision_start_id=382, vision_end_id=383)
