"""Collect the mini OCR proof into OUT/mini_ocr.json (`jaxflow_bench.results.write_result`) and OUT/reward_curve.png.

    python -m experiments.mini_ocr.result --out OUT --rl-seconds S [--arm ARM]

Reads OUT/eval/{before,after,control,before_train,after_train}.json (experiments.mini_ocr.evaluate),
OUT/rl/metrics.jsonl and OUT/rl_control/metrics.jsonl (the two RL runs), OUT/data/ocr_clean.json and
OUT/vae_report.json. With --arm ARM (experiments/mini_ocr/run.sh's ARM), the arm's names: eval/after_ARM.json,
eval/control_ARM.json, eval/after_ARM_train.json, rl_ARM/, rl_ARM_control/, and the result mini_ocr_ARM.json
(and for nft and cfgfree, whose evals run without CFG, eval/before_nft.json and eval/before_nft_train.json).
Figures: ocr_before/_se, ocr_after/_se, ocr_control_after/_se, ocr_rise (after - before) and its standard error,
ocr_train_before/after (the same on train words, which RL trains on), rl_steps, rl_minutes (the wall time of the
RL command); the per-step reward curves and a prompt-by-prompt breakdown (`breakdown`) go in as extra fields.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from PIL import Image, ImageDraw

from experiments.mini_ocr.algorithms import BEFORE
from jaxflow_bench.cli import bench_parser
from jaxflow_bench.results import write_result

COLOURS = {"rl": (200, 30, 30), "rl_control": (30, 30, 200)}


def rows(run: Path) -> list[dict]:
    out = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return sorted(out, key=lambda r: r["step"])


def trained_steps(run: Path) -> int:
    """The step of the run's newest checkpoint: what lora_final holds (a run cut by a time limit may have logged
    steps after it)."""
    return max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())


def curve(run: Path) -> list[float]:
    """Train reward (mean over the step's images) per step, up to the step lora_final holds."""
    last = trained_steps(run)
    return [round(float(r["reward_mean"]), 4) for r in rows(run) if r["step"] <= last]


def eval_curve(run: Path) -> list[list]:
    """[step, held-out reward] at the trainer's evals (eval.num_prompts prompts, ODE)."""
    return [[r["step"], round(float(r["eval_reward_mean"]), 4)] for r in rows(run) if "eval_reward_mean" in r]


def breakdown(before: list[float], after: list[float]) -> dict:
    """Prompt by prompt (the same prompts in the same order): how many score 0, in between and 1 before and after,
    and how many rose, fell or stayed. OCR scores are 1 - edit distance / length, so 0 and 1 are exact."""
    if len(before) != len(after):
        raise ValueError(f"before has {len(before)} scores and after {len(after)}: evaluate the same prompts")

    def levels(scores):
        return dict(zero=sum(s == 0 for s in scores), partial=sum(0 < s < 1 for s in scores),
                    perfect=sum(s == 1 for s in scores))

    pairs = list(zip(before, after))
    return dict(before=levels(before), after=levels(after), rose=sum(a > b for b, a in pairs),
                fell=sum(a < b for b, a in pairs), same=sum(a == b for b, a in pairs))


def plot(curves: dict[str, list[float]], path: Path, size=(480, 240), pad=30) -> None:
    """Train reward per step (y from 0 to 1), one line per run; RL red, control blue."""
    w, h = size
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    draw.rectangle((pad, 10, w - 10, h - pad), outline="black")
    steps = max(len(c) for c in curves.values())
    for name, values in curves.items():
        xy = [(pad + (w - 10 - pad) * i / max(steps - 1, 1), h - pad - (h - pad - 10) * v) for i, v in
              enumerate(values)]
        draw.line(xy, fill=COLOURS.get(name, "black"), width=2)
    draw.text((pad, h - pad + 4), f"step 1..{steps}   train OCR reward (0..1): RL red, shuffled control blue",
              fill="black")
    image.save(path)


def main(argv=None) -> None:
    p = bench_parser(__doc__)
    p.add_argument("--rl-seconds", type=float, required=True)
    p.add_argument("--arm", default="", help="the algorithm arm of experiments/mini_ocr/run.sh's ARM (names its files)")
    a = p.parse_args(argv)
    arm = f"_{a.arm}" if a.arm else ""
    before = BEFORE.get(arm, "before")  # NFT and cfgfree evaluate without CFG (experiments/mini_ocr/run.sh)
    names = dict(before=before, before_train=f"{before}_train", after=f"after{arm}", control=f"control{arm}",
                 after_train=f"after{arm}_train")
    ev = {k: json.loads((a.out / "eval" / f"{name}.json").read_text()) for k, name in names.items()}
    runs = dict(rl=a.out / f"rl{arm}", rl_control=a.out / f"rl{arm}_control")
    curves = {name: curve(run) for name, run in runs.items()}
    plot(curves, a.out / f"reward_curve{arm}.png")
    figures = dict(ocr_before=ev["before"]["mean"], ocr_before_se=ev["before"]["se"],
                   ocr_after=ev["after"]["mean"], ocr_after_se=ev["after"]["se"],
                   ocr_control_after=ev["control"]["mean"], ocr_control_after_se=ev["control"]["se"],
                   ocr_rise=ev["after"]["mean"] - ev["before"]["mean"],
                   ocr_rise_se=math.hypot(ev["before"]["se"], ev["after"]["se"]),
                   ocr_train_before=ev["before_train"]["mean"], ocr_train_after=ev["after_train"]["mean"],
                   eval_prompts=ev["before"]["n"], rl_steps=len(curves["rl"]), rl_minutes=a.rl_seconds / 60)
    extra = dict(reward_curve=curves["rl"], control_reward_curve=curves["rl_control"],
                 eval_curve=eval_curve(runs["rl"]), control_eval_curve=eval_curve(runs["rl_control"]),
                 prompts=dict(rl=breakdown(ev["before"]["scores"], ev["after"]["scores"]),
                              control=breakdown(ev["before"]["scores"], ev["control"]["scores"])),
                 ocr_clean_renders=json.loads((a.out / "data" / "ocr_clean.json").read_text()),
                 vae=json.loads((a.out / "vae_report.json").read_text()))
    path = write_result(a.out, f"mini_ocr{arm}", figures, extra=extra)
    print(json.dumps(figures, indent=1), "->", path)


if __name__ == "__main__":
    main()
