"""Token-active FLOP model of a dual-stream (MMDiT) transformer from its diffusers config (docs/design.md §5): never
6 x parameters x tokens."""
from __future__ import annotations

DATASHEET_TFLOPS = 989.0  # H100 SXM / H200 dense bf16


def mmdit_flops(cfg: dict, img_tokens: int, txt_tokens: int, lora_rank: int = 0, lora_targets: int = 12) -> dict:
    """Model FLOPs per sample for one transformer call: forward, LoRA train (frozen base), full fine-tune."""
    d, layers = cfg["num_attention_heads"] * cfg["attention_head_dim"], cfg["num_layers"]
    s = img_tokens + txt_tokens
    stream = 12 * d * d  # q, k, v, out (4 d^2) + MLP d->4d->d (8 d^2): each token through its own stream
    f_lin = 2 * layers * stream * s
    f_lin += 2 * (cfg["in_channels"] * d * img_tokens + cfg["joint_attention_dim"] * d * txt_tokens
                  + d * cfg["in_channels"] * img_tokens)
    f_attn = 4 * s * s * d * layers
    # LoRA r on q,k,v,out (4 x r(d+d)) and the MLP pair (r(d+4d) x 2) per stream, when all 12 targets are on.
    lora_active = layers * lora_rank * (8 * d + 10 * d) if lora_targets == 12 else 0
    return {"fwd": f_lin + f_attn, "lora_train": 2 * f_lin + 3.5 * f_attn + 6 * lora_active * s,
            "full_train": 3 * f_lin + 3.5 * f_attn, "attn_share": f_attn / (f_lin + f_attn),
            "lora_active_params": lora_active}
