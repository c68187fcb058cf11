"""The rollout benchmarks' workload: two OCR prompts, the seed table's and the training rollout's sampling settings
(512^2; 50 ODE steps without CFG, or the recipe's 10 steps, true CFG 4, SDE window 2), the 12 LoRA targets and a
random PEFT adapter on them (scripts/bench_rollout_engines.py, bench_rollout_lora.py). numpy only: the rollout side
runs without JAX.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

PROMPTS = ['a wooden shop sign above a bakery door that reads "Fresh Bread Daily"',
           'A vintage poster with the title "JAXFLOW" above a rocket']
SEED_SETTINGS = dict(height=512, width=512, num_inference_steps=50, true_cfg_scale=1.0, sde_type="ode",
                     noise_level=0.0, sde_window_size=None)
TRAIN_SETTINGS = dict(height=512, width=512, num_inference_steps=10, true_cfg_scale=4.0, sde_type="sde",
                      noise_level=1.2, sde_window_size=2, sde_window_range=(0, 5))
TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
           "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")


def random_adapter(model: Path, rank: int, seed: int, shapes=None) -> dict:
    """PEFT tensors (float32) of a random r=`rank` adapter on the 12 targets; each adds ~5% of the input RMS."""
    import json

    from jaxflow.config.recipes import base
    from jaxflow_bridge.engines import families

    parameter_shapes = families.module(base().model.family, "random_init").parameter_shapes  # the recipe's family
    shapes = shapes or dict(parameter_shapes(json.loads((model / "transformer" / "config.json").read_text())))
    rng, out = np.random.default_rng(seed), {}
    for name, shape in sorted(shapes.items()):
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or not any(module.endswith("." + t) for t in TARGETS):
            continue
        fan_out, fan_in = shape
        out[f"{module}.lora_A.weight"] = (rng.standard_normal((rank, fan_in)) / np.sqrt(fan_in)).astype(np.float32)
        out[f"{module}.lora_B.weight"] = (rng.standard_normal((fan_out, rank)) * 0.05 / np.sqrt(rank)).astype(
            np.float32)
    return out
