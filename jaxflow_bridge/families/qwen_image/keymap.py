"""The one declarative map between diffusers' Qwen-Image state dict and the Flax parameter tree.

Pure Python (no jax/torch import). Flax paths are tuples of nnx state keys; per-block diffusers keys use `{i}`
and map onto the stacked (scan) axis of the Flax leaf.
"""
from __future__ import annotations

from jaxflow_bridge.contract.weight_keys import Entry

# Flax module path -> diffusers module name. Linear = kernel/bias (kernel is the transposed torch weight).
TOP_LINEARS = {
    ("img_in",): "img_in",
    ("txt_in",): "txt_in",
    ("time_linear_1",): "time_text_embed.timestep_embedder.linear_1",
    ("time_linear_2",): "time_text_embed.timestep_embedder.linear_2",
    ("norm_out",): "norm_out.linear",
    ("proj_out",): "proj_out",
}
TOP_NORMS = {("txt_norm",): "txt_norm"}
BLOCK_LINEARS = {
    ("img_mod",): "img_mod.1",
    ("txt_mod",): "txt_mod.1",
    ("attn", "to_q"): "attn.to_q",
    ("attn", "to_k"): "attn.to_k",
    ("attn", "to_v"): "attn.to_v",
    ("attn", "to_out"): "attn.to_out.0",
    ("attn", "add_q_proj"): "attn.add_q_proj",
    ("attn", "add_k_proj"): "attn.add_k_proj",
    ("attn", "add_v_proj"): "attn.add_v_proj",
    ("attn", "to_add_out"): "attn.to_add_out",
    ("img_mlp_in",): "img_mlp.net.0.proj",
    ("img_mlp_out",): "img_mlp.net.2",
    ("txt_mlp_in",): "txt_mlp.net.0.proj",
    ("txt_mlp_out",): "txt_mlp.net.2",
}
BLOCK_NORMS = {
    ("attn", "norm_q"): "attn.norm_q",
    ("attn", "norm_k"): "attn.norm_k",
    ("attn", "norm_added_q"): "attn.norm_added_q",
    ("attn", "norm_added_k"): "attn.norm_added_k",
}
BLOCKS = "blocks"
DIFFUSERS_BLOCKS = "transformer_blocks"

# LoRA target names as users (flow_grpo, verl-omni, PEFT) write them: the diffusers name inside a block.
LORA_TARGETS = {name.removeprefix("attn."): path for path, name in BLOCK_LINEARS.items()}
DEFAULT_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                        "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")


def _entries(linears, norms, prefix_flax, prefix_torch, stacked) -> list[Entry]:
    out = []
    for path, name in linears.items():
        out.append(Entry(prefix_flax + path + ("kernel",), f"{prefix_torch}{name}.weight", True, stacked))
        out.append(Entry(prefix_flax + path + ("bias",), f"{prefix_torch}{name}.bias", False, stacked))
    for path, name in norms.items():
        out.append(Entry(prefix_flax + path + ("scale",), f"{prefix_torch}{name}.weight", False, stacked))
    return out


def transformer_key_map() -> list[Entry]:
    """Every base parameter of the Flax QwenImageTransformer and its diffusers key."""
    return (_entries(TOP_LINEARS, TOP_NORMS, (), "", False)
            + _entries(BLOCK_LINEARS, BLOCK_NORMS, (BLOCKS,), DIFFUSERS_BLOCKS + ".{i}.", True))


def lora_target_path(target: str) -> tuple[str, ...]:
    if target not in LORA_TARGETS:
        raise ValueError(f"unknown LoRA target {target!r}; known: {sorted(LORA_TARGETS)}")
    return LORA_TARGETS[target]


def lora_key_map(targets) -> list[Entry]:
    """LoRA leaves (A: (in, r), B: (r, out)) <-> PEFT keys (lora_A.weight (r, in), lora_B.weight (out, r))."""
    out = []
    for t in targets:
        path = lora_target_path(t)
        name = BLOCK_LINEARS[path]
        for leaf, peft in (("lora_a", "lora_A"), ("lora_b", "lora_B")):
            out.append(Entry((BLOCKS,) + path + (leaf,), f"{DIFFUSERS_BLOCKS}.{{i}}.{name}.{peft}.weight", True, True))
    return out
