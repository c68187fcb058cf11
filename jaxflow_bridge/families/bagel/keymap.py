"""The declarative map between BAGEL's checkpoint names (`ema.safetensors`, as vLLM-Omni's BagelPipeline loads
them) and the Flax BagelModel's parameter tree, plus the numpy conversion both ways and the LoRA naming rule the
BAGEL engines share.

Pure Python and numpy (no jax/torch). Per-layer keys use `{i}` and map onto the stacked (scan) axis of the Flax
leaf; each expert's names come from one pattern, `{g}` = "" (understanding) or "_moe_gen" (generation).
"""
from __future__ import annotations

import numpy as np

from jaxflow_bridge.contract.lora import LORA_KEY, refusal
from jaxflow_bridge.contract.weight_keys import Entry

LLM = "language_model.model."
LAYERS, CHECKPOINT_LAYERS = "layers", LLM + "layers.{i}."
EXPERTS = {"und": "", "gen": "_moe_gen"}
# Flax module path -> checkpoint module name; Linear = kernel (the transposed torch weight) and bias when present.
TOP_LINEARS = {
    ("time_embedder_1",): "time_embedder.mlp.0",
    ("time_embedder_2",): "time_embedder.mlp.2",
    ("vae2llm",): "vae2llm",
    ("llm2vae",): "llm2vae",
}
TOP_NORMS = {("norm_moe_gen",): LLM + "norm_moe_gen"}
TOP_TABLES = {("embed_tokens",): LLM + "embed_tokens.weight", ("latent_pos_embed",): "latent_pos_embed.pos_embed"}
# expert leaf -> (checkpoint pattern, has a bias)
EXPERT_LINEARS = {
    "q_proj": ("self_attn.q_proj{g}", True),
    "k_proj": ("self_attn.k_proj{g}", True),
    "v_proj": ("self_attn.v_proj{g}", True),
    "o_proj": ("self_attn.o_proj{g}", False),
    "gate_proj": ("mlp{g}.gate_proj", False),
    "up_proj": ("mlp{g}.up_proj", False),
    "down_proj": ("mlp{g}.down_proj", False),
}
EXPERT_NORMS = {
    "q_norm": "self_attn.q_norm{g}",
    "k_norm": "self_attn.k_norm{g}",
    "input_layernorm": "input_layernorm{g}",
    "post_attention_layernorm": "post_attention_layernorm{g}",
}
# Checkpoint tensors the trainer's generation path never reads (by prefix): the LM head and the understanding
# expert's final norm feed text logits only; the ViT, its connector and position table serve image understanding.
IGNORED_PREFIXES = ("language_model.lm_head.", LLM + "norm.", "vit_model.", "connector.", "vit_pos_embed.")


def key_map() -> list[Entry]:
    """Every parameter of the Flax BagelModel and its checkpoint key (`{i}` for the stacked layers)."""
    out = [Entry(path, key, False, False) for path, key in TOP_TABLES.items()]
    for path, name in TOP_LINEARS.items():
        out += [Entry(path + ("kernel",), f"{name}.weight", True, False), Entry(path + ("bias",), f"{name}.bias",
                                                                                False, False)]
    out += [Entry(path + ("scale",), f"{name}.weight", False, False) for path, name in TOP_NORMS.items()]
    for expert, g in EXPERTS.items():
        prefix = (LAYERS, expert)
        for leaf, (pattern, bias) in EXPERT_LINEARS.items():
            name = CHECKPOINT_LAYERS + pattern.format(g=g)
            out.append(Entry(prefix + (leaf, "kernel"), f"{name}.weight", True, True))
            if bias:
                out.append(Entry(prefix + (leaf, "bias"), f"{name}.bias", False, True))
        for leaf, pattern in EXPERT_NORMS.items():
            out.append(Entry(prefix + (leaf, "scale"), f"{CHECKPOINT_LAYERS}{pattern.format(g=g)}.weight", False, True))
    return out

# LoRA (docs/bagel.md §5): the generation expert's seven projections, named as PEFT / verl-omni / vLLM-Omni write
# them: the checkpoint module name inside a layer, without `self_attn.` (`q_proj_moe_gen`) but keeping `mlp_moe_gen.`
# (the bare `gate_proj` would also match the understanding MLP). target -> expert leaf. The understanding expert has
# no targets: adapting it would make the context K/V policy-dependent.
GEN = "gen"
LORA_TARGETS = {pattern.format(g=EXPERTS[GEN]).removeprefix("self_attn."): leaf
                for leaf, (pattern, _) in EXPERT_LINEARS.items()}
DEFAULT_LORA_TARGETS = tuple(LORA_TARGETS)
# PEFT's state-dict prefix (adapter_model.safetensors keys: base_model.model.language_model.model.layers.{i}. ...)
PEFT_PREFIX = "base_model.model."
TARGET_ENDS = tuple(f".{t}" for t in LORA_TARGETS)  # a module's name ends with its target (`.q_proj_moe_gen`)


def generation_expert_adapter(tensors: dict) -> dict:
    """An adapter's tensors under BAGEL's checkpoint module names (PEFT_PREFIX dropped), as every BAGEL engine takes
    them; refused in one line naming each LoRA tensor off the generation expert's targets (adapting anything else,
    the understanding expert above all, would make the context K/V policy-dependent)."""
    tensors = {k.removeprefix(PEFT_PREFIX): v for k, v in tensors.items()}
    off = sorted(k for k in tensors if (m := LORA_KEY.fullmatch(k)) and not m["module"].endswith(TARGET_ENDS))
    if off:
        raise refusal([f"{k}: not a generation-expert LoRA target {sorted(LORA_TARGETS)}" for k in off],
                      "tensors off the generation expert")
    return tensors


def lora_target_path(target: str) -> tuple[str, ...]:
    """The Flax module path (stacked layers, generation expert) a LoRA target adapts; an unknown one by name."""
    if target not in LORA_TARGETS:
        raise ValueError(f"unknown BAGEL LoRA target {target!r}; known (generation expert only): "
                         f"{sorted(LORA_TARGETS)}")
    return (LAYERS, GEN, LORA_TARGETS[target])


def lora_key_map(targets) -> list[Entry]:
    """LoRA leaves (A: (L, in, r), B: (L, r, out)) <-> PEFT keys without PEFT_PREFIX (lora_A.weight (r, in),
    lora_B.weight (out, r) per layer), e.g. `language_model.model.layers.{i}.self_attn.q_proj_moe_gen.lora_A.weight`."""
    out = []
    for t in dict.fromkeys(targets):
        path = lora_target_path(t)
        name = CHECKPOINT_LAYERS + EXPERT_LINEARS[path[-1]][0].format(g=EXPERTS[GEN])
        for leaf, peft in (("lora_a", "lora_A"), ("lora_b", "lora_B")):
            out.append(Entry(path + (leaf,), f"{name}.{peft}.weight", True, True))
    return out


def _check_names(given, expected, what: str) -> None:
    missing, extra = sorted(set(expected) - set(given)), sorted(set(given) - set(expected))
    if missing or extra:
        raise ValueError(f"{what} do not match BAGEL's key map: missing {missing}, unexpected {extra}")


def to_flax(tensors: dict[str, np.ndarray], num_layers: int) -> dict[tuple[str, ...], np.ndarray]:
    """Checkpoint tensors (name -> array in torch layout) -> Flax path -> array (transposed, layers stacked).
    Ignored names (IGNORED_PREFIXES) are dropped; a missing or unexpected name is reported by name."""
    entries = key_map()
    used = {k: v for k, v in tensors.items() if not k.startswith(IGNORED_PREFIXES)}
    _check_names(used, [k for e in entries for k in e.diffusers_keys(num_layers)], "checkpoint names")
    out = {}
    for e in entries:
        parts = [used[k].T if e.transpose else used[k] for k in e.diffusers_keys(num_layers)]
        out[e.flax_path] = np.stack(parts) if e.stacked else parts[0]
    return out


def to_checkpoint(params: dict[tuple[str, ...], np.ndarray], num_layers: int) -> dict[str, np.ndarray]:
    """Flax path -> array back to checkpoint name -> array (torch layout, one tensor per layer)."""
    entries = key_map()
    _check_names(params, [e.flax_path for e in entries], "Flax paths")
    out = {}
    for e in entries:
        value = params[e.flax_path]
        if e.stacked and value.shape[0] != num_layers:
            raise ValueError(f"{'/'.join(e.flax_path)} stacks {value.shape[0]} layers, expected {num_layers}")
        for i, key in enumerate(e.diffusers_keys(num_layers)):
            v = value[i] if e.stacked else value
            out[key] = v.T if e.transpose else v
    return out
