"""Collect the mini edit proof into OUT/mini_edit.json (`jaxflow_bench.results.write_result`) and
OUT/reward_curve.png.

    python -m experiments.mini_edit.result --out OUT --rl-seconds S

Reads OUT/eval/{before,after,control}.json (experiments.mini_edit.evaluate on the held-out pairs), OUT/pick.json
(experiments.mini_edit.pick), OUT/rl/ and OUT/rl_control/ (the two RL runs' metrics.jsonl and checkpoints, through
mini_ocr's result helpers) and OUT/vae_report.json. Figures: pretrain_steps (the picked snapshot's step) and
pick_edit_ocr (its score on the pick's pairs), edit_ocr_before/_se, edit_ocr_after/_se, edit_ocr_rise (after -
before) and its standard error, edit_ocr_control_after/_se and edit_ocr_control_rise, eval_pairs, rl_steps,
rl_minutes (the wall time of the RL command); the per-step reward curves and every snapshot's pick score (`pick`) go
in as extra fields. The proof asks edit_ocr_rise >= 0.2 with the control's rise near 0.
"""
from __future__ import annotations

import json
import math

from experiments.mini_ocr.result import curve, eval_curve, plot
from jaxflow_bench.cli import bench_parser
from jaxflow_bench.results import write_result


def main(argv=None) -> None:
    p = bench_parser(__doc__)
    p.add_argument("--rl-seconds", type=float, required=True)
    a = p.parse_args(argv)
    ev = {k: json.loads((a.out / "eval" / f"{k}.json").read_text()) for k in ("before", "after", "control")}
    runs = dict(rl=a.out / "rl", rl_control=a.out / "rl_control")
    curves = {name: curve(run) for name, run in runs.items()}
    plot(curves, a.out / "reward_curve.png")
    before, after, control = ev["before"], ev["after"], ev["control"]
    pick = json.loads((a.out / "pick.json").read_text())
    figures = dict(pretrain_steps=pick["step"], pick_edit_ocr=pick["mean"],
                   edit_ocr_before=before["mean"], edit_ocr_before_se=before["se"],
                   edit_ocr_after=after["mean"], edit_ocr_after_se=after["se"],
                   edit_ocr_rise=after["mean"] - before["mean"], edit_ocr_rise_se=math.hypot(before["se"], after["se"]),
                   edit_ocr_control_after=control["mean"], edit_ocr_control_after_se=control["se"],
                   edit_ocr_control_rise=control["mean"] - before["mean"],
                   eval_pairs=before["n"], rl_steps=len(curves["rl"]), rl_minutes=a.rl_seconds / 60)
    extra = dict(pick=pick, reward_curve=curves["rl"], control_reward_curve=curves["rl_control"],
                 eval_curve=eval_curve(runs["rl"]), control_eval_curve=eval_curve(runs["rl_control"]),
                 vae=json.loads((a.out / "vae_report.json").read_text()))
    path = write_result(a.out, "mini_edit", figures, extra=extra)
    print(json.dumps(figures, indent=1), "->", path)


if __name__ == "__main__":
    main()
