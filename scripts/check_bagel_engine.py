"""The vllm_omni engine serving BAGEL on a GPU (docs/bagel.md §7 (d)): start, samples, LoRA.

    python scripts/check_bagel_engine.py [--model DIR] [--rank 8] [--json OUT]

On a BAGEL folder saved in bf16 (default: the tiny random one): starts the engine (vLLM-Omni's single-stage
deployment; the engine refuses more than one stage), samples 2 prompts x 2 images twice with the same seeds (the
same bytes), then with a random rank-R adapter on the generation expert loaded through a PEFT folder (every
adapter module bound, the samples moved), a second adapter written into that adapter's LoRA slots in place
(`update_lora_shared`: it falls back to a folder, and says so, when a module finds no `bagel.`-prefixed wrapped
layer in vLLM-Omni's manager) and the same second adapter loaded through a folder: both must sample the same
bytes. Prints one line per check, PASS/FAIL last; exits 1 if a check fails. --json writes the checks and figures.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

PROMPTS = ['A storefront sign that reads "OPEN 24 HOURS" in red neon', "a red fox"]
SAMPLING = {"height": 64, "width": 96, "num_inference_steps": 4, "sde_window_size": 2, "sde_window_range": (0, 3),
            "cfg_text_scale": 4.0, "noise_level": 0.7}
SEEDS = [11, 12, 13, 14]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="BAGEL folder saved in bf16 (default: the tiny random one)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank of the random adapters (alpha = rank)")
    p.add_argument("--json", type=Path, help="write the checks and figures here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from jaxflow.families.bagel.lora import BagelLoRASpec
    from jaxflow.trainer.parity import random_adapter
    from jaxflow_bridge.contract.lora_shm import SharedAdapterFile
    from jaxflow_bridge.contract.trajectory import TrajectoryBatch
    from jaxflow_bridge.engines.vllm_omni.engine import VllmOmniEngine

    if args.model is None:
        from jaxflow_bridge.families.bagel.tiny import tiny_bagel_path

        args.model = tiny_bagel_path(dtype="bfloat16")
    layers = json.loads((args.model / "llm_config.json").read_text())["num_hidden_layers"]
    spec = BagelLoRASpec(rank=args.rank, alpha=float(args.rank))
    config = spec.peft_config()
    first, second = (random_adapter(args.model, spec, seed, round_to=ml_dtypes.bfloat16) for seed in (1, 2))

    t = time.perf_counter()
    engine = VllmOmniEngine({"engine": "vllm_omni", "model": str(args.model), "dtype": "bfloat16"})
    start_s = time.perf_counter() - t

    def sample() -> TrajectoryBatch:
        return TrajectoryBatch.from_dict(engine.generate(PROMPTS, 2, SAMPLING, seeds=SEEDS))

    t = time.perf_counter()
    base = sample()
    generate_s = time.perf_counter() - t
    again = sample()
    bound = engine.update_lora(first, 1, config)["bound_modules"]
    adapted = sample()
    shared = SharedAdapterFile("bfloat16")
    in_place = engine.update_lora_shared(shared.write_arrays(second), 2, config)
    written = sample()
    engine.update_lora(second, 3, config)
    loaded = sample()
    shared.close()

    n = len(PROMPTS) * 2
    checks = {
        "shapes": base.images.shape == (n, SAMPLING["height"], SAMPLING["width"], 3)
        and base.log_probs.shape == (n, SAMPLING["sde_window_size"]) and base.latents.shape[2:] == (24, 64),
        "finite": bool(np.isfinite(base.log_probs).all() and np.isfinite(base.latents).all()),
        "token_ids": base.text_kind == "ids" and base.negative_prompt_ids.shape == (n, 0),
        "same_seeds_same_bytes": np.array_equal(base.latents, again.latents)
        and np.array_equal(base.images, again.images),
        "lora_binds_every_target": bound == len(spec.targets) * layers,
        "lora_moves_samples": not np.array_equal(adapted.latents, base.latents),
        "in_place_write_taken": "seconds" in in_place,
        "in_place_equals_folder_load": np.array_equal(written.latents, loaded.latents)
        and np.array_equal(written.log_probs, loaded.log_probs),
        "second_adapter_differs": not np.array_equal(written.latents, adapted.latents),
    }
    figures = {"engine_start_s": start_s, "generate_s": generate_s, "bound_modules": bound,
               "in_place_write_s": in_place.get("seconds"),
               "max_abs_dlogp_in_place_vs_folder": float(np.abs(written.log_probs - loaded.log_probs).max())}
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    for name, value in figures.items():
        print(f"     {name} = {value}")
    passed = all(checks.values())
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "checks": checks, "figures": figures,
                                         "passed": passed}, indent=1, default=bool))
    print(f"{'PASS' if passed else 'FAIL'}: {sum(checks.values())}/{len(checks)} engine checks")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
