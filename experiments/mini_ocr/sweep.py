"""The knob sweep of the mini OCR proof: named variants of configs/mini_ocr.py's FlowGRPO and NFT arms, and the
collector of their runs into OUT/mini_ocr_sweep.json.

    python -m experiments.mini_ocr.sweep args NAME          # the variant's --config overrides, one line
    python -m experiments.mini_ocr.sweep arm NAME           # the arm it varies (ARM of run.sh; empty: FlowGRPO)
    python -m experiments.mini_ocr.sweep collect --out OUT --pipelines P0 [P1 ...] [--eval-steps 40]

experiments/mini_ocr/sweep.sh runs each variant NAME on each pipeline as `experiments/mini_ocr/run.sh` with its ARM and
RUN=sweep_NAME (eval/after_sweep_NAME.json, rl_sweep_NAME/, the "rl_sweep_NAME N s" line of timings.txt). Figures
per variant, as experiments.mini_ocr.algorithms's per arm: `NAME/rise`, `NAME/rise_se`, `NAME/steps`, ... and
`NAME/rise_vs_REFERENCE` (the mean paired difference with its arm as configured on the same pipelines: `baseline`
for FlowGRPO's variants, `nft` for NFT's) with `NAME/rise_vs_REFERENCE_se`. `--eval-steps N`: of the evals at N
steps (run.sh's EVAL_ALSO_STEPS), into OUT/mini_ocr_sweep_sN.json.

The questions: which knob holds FlowGRPO's rise below DiffusionNFT's and AWM's on the same pipelines (BENCHMARKS.md,
"Mini OCR: the algorithm arms"; the answers so far: "Mini OCR: FlowGRPO's knobs"), and what holds NFT's train reward
at about 0.90 from the step its old policy's decay reaches its cap (docs/mini_ocr.md). configs/mini_ocr.py is
flow_grpo's SD3 OCR recipe (lr 3e-4, clip 1e-4, 9 of 10 steps trained, noise 0.7) with beta 0, group 12, CFG 4.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import NamedTuple

from experiments.mini_ocr.algorithms import BEFORE, eval_tag, run_of, summarize
from jaxflow_bench.results import write_result


class Variant(NamedTuple):
    settings: dict  # overrides of the arm's config, by dotted key
    why: str
    arm: str = ""  # configs/mini_ocr.py's arm it varies ("": FlowGRPO)


# each arm's variant that leaves it as configured: the reference its other variants are paired with
REFERENCE = {"": "baseline", "nft": "nft"}
# name: Variant(overrides of the arm's config, why this variant[, arm])
VARIANTS = {name: Variant(*v) for name, v in {
    "baseline": ({}, "the arm as configured, run beside the variants on the same pipelines: the pairing's reference"),
    "lr2x": ({"train.learning_rate": 6e-4}, "50-60 steps in 7 minutes: is the step size what is short?"),
    "lr4x": ({"train.learning_rate": 1.2e-3}, "the same, further; where the gain stops (or the run breaks)"),
    "clip1e3": ({"train.clip_range": 1e-3}, "two updates a step: at 1e-4 (flow_grpo's SD3) the second may be "
                                            "mostly clipped; 1e-3 is flow_grpo's Wan 2.1 OCR value"),
    "kl": ({"train.beta": 0.004}, "flow_grpo trains OCR with a KL term (SD3 0.04, Wan 0.004); the arm has none: "
                                  "does anchoring to the base help or only slow the rise?"),
    "window5": ({"sample.window_size": 5}, "train 5 of the 10 steps (start drawn per sample in [0, 9)) instead "
                                           "of 9: a cheaper train phase, more steps in the minutes"),
    "group8": ({"sample.group_size": 8, "sample.prompts_per_step": 24, "sample.prompts_per_call": 24},
               "flow_grpo's one-GPU OCR group: the same 192 images a step over 24 prompts, noisier baselines"),
    "noise1": ({"sample.noise_level": 1.0}, "more SDE noise than flow_grpo's SD3 0.7: a wider reward spread "
                                            "within a group, so larger advantages"),
    "group16": ({"sample.group_size": 16, "sample.prompts_per_step": 12, "sample.prompts_per_call": 12},
                "flow_grpo's four-GPU OCR group: the same 192 images over 12 prompts, better baselines"),
    "cfg45": ({"sample.guidance": 4.5}, "flow_grpo's SD3 OCR guidance in the rollouts (the evals stay at 4)"),
    "clip1e2": ({"train.clip_range": 1e-2}, "late in a run the policy moves about the clip range a step (RMS log-ratio "
                                            "~1e-4); NFT and AWM, which rose more, clip at 1.0 or not at all"),
    "clip1e3_lr4x": ({"train.clip_range": 1e-3, "train.learning_rate": 1.2e-3},
                     "a wider clip with the larger step that can use it: lr alone moved the rise by under 1 se"),
    "nft": ({}, "the NFT arm as configured (its old policy's decay 0 for 75 updates, then +0.0075 an update up to "
                "0.999, DiffusionNFT's OCR recipe): its variants' pairing reference", "nft"),
    "nft_decay1": ({"train.nft.decay_flat": 0, "train.nft.decay_rate": 0.001, "train.nft.decay_max": 0.5},
                   "DiffusionNFT's decay type 1: the old policy (the rollouts') keeps following the LoRA; at 0.999 "
                   "from update 208 on it all but stops, where the train reward stops rising", "nft"),
    "nft_decay0": ({"train.nft.decay_max": 0.0}, "decay type 0: the old policy is the LoRA after every step "
                                                 "(on-policy rollouts)", "nft"),
    "nft_lr2x": ({"train.learning_rate": 6e-4}, "the configured schedule and type 1 both level at a train reward "
                                                "near 0.90: is it the step size?", "nft"),
    "nft_rank64": ({"lora.rank": 64, "lora.alpha": 128.0}, "or the adapter's capacity (rank 32, alpha 2 x rank "
                                                           "kept)?", "nft"),
}.items()}
# the first sweep: 8 runs a pipeline, so two pipelines fill a 4-GPU host's 8 slots (PER_GPU=2) once
FIRST = ("baseline", "lr2x", "lr4x", "clip1e3", "kl", "window5", "group8", "noise1")


def cli_value(value) -> str:
    """A value as a --config.KEY=VALUE override reads it, without spaces (run.sh splits RL_ARGS on them)."""
    return repr(value).replace(" ", "")


def overrides(name: str) -> list[str]:
    """The variant's --config.KEY=VALUE arguments."""
    return [f"--config.{key}={cli_value(value)}" for key, value in VARIANTS[name].settings.items()]


def collect(pipelines: list[Path], eval_steps: int | None = None) -> dict:
    """Every variant's figures, each arm's paired with its `REFERENCE` on the same pipelines (of the evals at
    `eval_steps` denoising steps where given)."""
    tag, hint = eval_tag(eval_steps)
    figures = {}
    for arm, reference in REFERENCE.items():
        before = BEFORE.get(f"_{arm}")
        runs = {name: {p.name: r for p in pipelines if (r := run_of(p, f"_sweep_{name}", before, tag))}
                for name, v in VARIANTS.items() if v.arm == arm}
        figures.update(summarize(runs, reference))
    if not figures:
        raise ValueError(f"no eval/after_sweep_*{tag}.json in {[str(p) for p in pipelines]}: "
                         f"run experiments/mini_ocr/sweep.sh first{hint}")
    return figures


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("args", help="print a variant's --config overrides").add_argument("name")
    sub.add_parser("arm", help="print the arm a variant varies (empty: FlowGRPO)").add_argument("name")
    c = sub.add_parser("collect", help="write OUT/mini_ocr_sweep.json")
    c.add_argument("--out", type=Path, required=True, help="folder for the result file")
    c.add_argument("--pipelines", type=Path, nargs="+", required=True, help="experiments/mini_ocr/run.sh OUT folders")
    c.add_argument("--eval-steps", type=int, help="the evals at N denoising steps (run.sh's EVAL_ALSO_STEPS)")
    a = p.parse_args(argv)
    if a.command in ("args", "arm"):
        if a.name not in VARIANTS:
            p.error(f"unknown sweep variant {a.name!r}; choose from {' '.join(VARIANTS)}")
        print(" ".join(overrides(a.name)) if a.command == "args" else VARIANTS[a.name].arm)
        return
    figures = collect(a.pipelines, a.eval_steps)
    extra = dict(variants={name: dict(overrides=overrides(name), why=v.why, arm=v.arm or "flowgrpo")
                           for name, v in VARIANTS.items() if f"{name}/rise" in figures})
    path = write_result(a.out, "mini_ocr_sweep" + eval_tag(a.eval_steps)[0], figures, extra=extra)
    print(json.dumps(figures, indent=1), "->", path)


if __name__ == "__main__":
    main()
