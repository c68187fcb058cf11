"""The planner's cost table, `jaxflow/config/phase_costs.json`, from measured result files: per engine and card the
seconds per image of the rollout, the old log-probs and the update, the seconds per step of the LoRA sync and the
reward's tail, and the engine's working memory beside its weights, each row for the family it was measured on (the
planner predicts a family's step only from its own rows) with its config's transformer passes per image
(`jaxflow.config.work`; `forward_share`: a forward-only pass's cost against a forward-and-backward one's, from a row
that measured both, for a config whose passes differ); and the update's memory per sample and fixed, from the
micro-batch fit (`scripts/fit_micro_batch.py`); and the short-run start's compile saving and step cost, from
README's command started cold both ways (`short_start_row`). The planner (`jaxflow/config/planner.py`) reads it.

    python -m jaxflow_bench.phase_costs [--results benchmarks/results] [--out jaxflow/config/phase_costs.json]

Every row names its file, family and card. The measured model is the recipe's (configs/qwen_ocr.py) at full size
with random weights (its family's full_size.py builder), its sizes below; the edit recipe's (configs/qwen_edit_ocr.py)
has the same weights (the edit family's full_size.py builds on the text-to-image one's) and twice the image tokens.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from jaxflow.config.planner import GIB, LORA_RESIDENT_BYTES, TABLE, ModelSizes
from jaxflow.config.validation import config_module
from jaxflow.config.work import work_of
from jaxflow_bridge.engines import families

ROOT = Path(__file__).resolve().parents[1]
# the recipe's model in bf16 (full_size.py: the 20.4B transformer, the 8.3B text encoder, the VAE),
# the recipe's 512x512 images (32 x 32 latent tokens) and 96 prompt tokens; its LoRA as the fit measured it
RECIPE = dict(transformer_bytes=int(20.43e9 * 2), text_encoder_bytes=int(8.29e9 * 2), vae_bytes=int(0.127e9 * 2),
              layers=60, tokens=32 * 32 + 96)
MEMORY_FILE, MEMORY_CONFIG = "fit_micro_batch.json", "configs/qwen_ocr.py"  # the fit ran the recipe
# (file, the recipe it ran, engine, whether the engine runs on the trainer's weights, the JAX share of the
# GPU the run had: its XLA_CLIENT_MEM_FRACTION, the e2e benchmark's 1gpu default or its command's): each a recipe on
# one GPU
PHASE_FILES = (("e2e_recipe_vllm_omni_1gpu_runner.json", "configs/qwen_ocr.py", "vllm_omni", False, 0.56),
               ("e2e_recipe_diffusers_1gpu.json", "configs/qwen_ocr.py", "diffusers", False, 0.56),
               ("e2e_recipe_diffusers_h100.json", "configs/qwen_ocr.py", "diffusers", True, 0.745),
               ("e2e_edit_1gpu.json", "configs/qwen_edit_ocr.py", "vllm_omni", False, 0.56))


# README's GPU command (configs/qwen_ocr.py, 2 prompts x 16 images a step) cold, unrolled and with its blocks in a
# scan and XLA's linears: the keys of startup.json, and the images of its steps
SHORT_START = dict(file="startup.json", config="configs/qwen_ocr.py", unrolled="readme_cold_14th",
                   scanned="readme_scan_cold_14th", images=32)


def family_of(config: str) -> str:
    """The family whose E2E recipe (its spec.py) is `config`."""
    return next(name for name in families.FAMILIES if families.spec(name).E2E["config"] == config)


def card_of(device: str) -> tuple[str, float]:
    """("NVIDIA H200", GiB) of a result's device line ("NVIDIA H200, 143771 MiB")."""
    name, _, mib = device.rpartition(", ")
    return name, float(mib.split()[0]) / 1024


def memory_row(record: dict) -> tuple[dict, int]:
    """The update's fixed bytes per transformer byte and bytes per sample per `ModelSizes.scale`, a least-squares
    line through the fit's needs; and the LoRA parameters its resident bytes imply."""
    f = record["figures"]
    sizes = sorted(int(k.rsplit("mb", 1)[1]) for k in f if k.startswith("need_gib_mb"))
    per, fixed = np.polyfit(sizes, [f[f"need_gib_mb{m}"] * GIB for m in sizes], 1)
    lora = int((f["in_use_gib"] * GIB - RECIPE["transformer_bytes"]) / LORA_RESIDENT_BYTES)
    scale = ModelSizes(**RECIPE, lora_params=lora).scale
    return ({"file": MEMORY_FILE, "family": family_of(MEMORY_CONFIG), "card": card_of(record["device"])[0],
             "transformer_bytes": RECIPE["transformer_bytes"],
             "fixed_per_transformer_byte": float(fixed / RECIPE["transformer_bytes"]),
             "per_sample_per_scale": float(per / scale)}, lora)


def phase_row(name: str, record: dict, config: str, engine: str, share_weights: bool, jax_share: float) -> dict:
    """Per-image seconds of one e2e result of the recipe `config`, the JAX share it ran at, and the engine's working
    reserve: the GPU's peak less JAX's whole pool (preallocated: `jax_share` of the card) and the weights the engine
    holds (RECIPE's: the edit family's are the same)."""
    f = record["figures"]
    images = f["images_per_step"]
    card, gib = card_of(record["device"])
    weights = RECIPE["text_encoder_bytes"] + RECIPE["vae_bytes"] + (0 if share_weights else RECIPE["transformer_bytes"])
    return {"file": name, "family": family_of(config), "engine": engine, "share_weights": share_weights, "card": card,
            "card_gib": round(gib, 2), "micro_batch": int(f["micro_batch"]),
            "rollout_s_per_image": f["rollout_s"] / images,
            "old_log_prob_s_per_image": f["old_log_prob_s"] / images, "update_s_per_image": f["update_s"] / images,
            "sync_s": f["sync_s"], "reward_s": f["reward_s"], "jax_share": jax_share, "work": recipe_work(config),
            "engine_reserve_gib": round(f["peak_gib"] - jax_share * gib - weights / GIB, 2)}


def short_start_row(record: dict) -> dict:
    """The short-run start's costs (`planner.short_start`): how much longer the unrolled blocks compile, and the
    scan's extra seconds per image of a step (its steps after the first, against the unrolled run's)."""
    f, r = record["figures"], SHORT_START
    unrolled, scanned = (f"{r[k]}/" for k in ("unrolled", "scanned"))
    return {"file": r["file"], "family": family_of(r["config"]), "card": card_of(record["device"].split(" (")[0])[0],
            "compile_saving_s": f[unrolled + "compile_s"] - f[scanned + "compile_s"],
            "step_s_per_image": f[unrolled + "step_s"] / r["images"],
            "step_extra_s_per_image": (f[scanned + "step_s"] - f[unrolled + "step_s"]) / r["images"]}


def recipe_work(config: str) -> dict:
    """The transformer passes per image (`jaxflow.config.work`) of the recipe `config` as jaxflow_bench.e2e runs it
    (its settings; the prompts a step do not change them)."""
    return dataclasses.asdict(work_of(config_module(ROOT / config).get_config()))


def forward_share(phases: list[dict]) -> float:
    """What a forward-only pass costs against a forward-and-backward one, per image: the first row that measured
    both an old-log-prob pass and an update without forward-only passes."""
    row = next(r for r in phases if r["work"]["recompute"] and not r["work"]["forward"])
    forward = row["old_log_prob_s_per_image"] / row["work"]["recompute"]
    return forward / (row["update_s_per_image"] / row["work"]["train"])


def build(results: Path) -> dict:
    memory, _ = memory_row(json.loads((results / MEMORY_FILE).read_text()))
    phases = [phase_row(name, json.loads((results / name).read_text()), *row) for name, *row in PHASE_FILES]
    # an engine never measured: the largest reserve of the memory model's family (the rows its memory plan reads)
    short = short_start_row(json.loads((results / SHORT_START["file"]).read_text()))
    return {"written_by": "python -m jaxflow_bench.phase_costs", "memory": memory, "phases": phases,
            "short_start": [short],
            "forward_share": forward_share(phases),
            "default_engine_reserve_gib": max(r["engine_reserve_gib"] for r in phases
                                              if r["family"] == memory["family"])}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--out", type=Path, default=TABLE)
    args = p.parse_args(argv)
    args.out.write_text(json.dumps(build(args.results), indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
