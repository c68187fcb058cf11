"""Collect the arms' mini OCR runs over one or more pipelines into OUT/mini_ocr_algorithms.json (the algorithm arms,
paired against FlowGRPO) and OUT/mini_ocr_fp8.json (the vLLM-Omni arms: omni_fp8 paired against omni, the bf16 DiT).

    python -m experiments.mini_ocr.algorithms --out OUT --pipelines P0 [P1 ...] [--exclude P0/nft ...] [--eval-steps 40]

Each pipeline folder is one experiments/mini_ocr/run.sh OUT (its eval/before.json, and per arm ARM that ran on it:
eval/after_ARM.json, rl_ARM/checkpoints (or, in a copy without checkpoints, the last step of rl_ARM/metrics.jsonl),
the "rl_ARM N s" line of timings.txt; FlowGRPO has no suffix; NFT and cfgfree, whose
evals run without CFG, are measured from eval/before_nft.json, omni and omni_fp8 from eval/before_omni.json, the
eval of the bf16 folder they train on). A result is written where any of its arms ran. Figures per arm:
`ARM/before` and `ARM/after` (held-out OCR, means over the pipelines it ran on), `ARM/rise` (after - before),
`ARM/rise_se` (its standard error: the pipelines' errors combined), `ARM/rise_min` (the lowest pipeline's),
`ARM/steps` and `ARM/minutes` (mean trained steps and wall minutes of the RL command), `ARM/pipelines`;
where rl_ARM/metrics.jsonl logs them, `ARM/train_reward_first` and `ARM/train_reward_last` (the rollouts' mean
reward over the first and the last `EDGE` steps: the train side's rise, from SDE samples where the eval's are ODE),
`ARM/approx_kl_late` and `ARM/clipfrac_late` (medians from step `LATE` on: how far an update moves the policy);
`ARM/PIPELINE/rise` and `.../rise_se` for each pipeline, and `ARM/rise_vs_BASELINE` (flowgrpo, or omni in
mini_ocr_fp8.json: the mean paired difference over the pipelines both ran on) with `ARM/rise_vs_BASELINE_se` (from
the evals' errors; a "before" both share cancels). `--exclude PIPELINE/ARM` leaves out a run known to be invalid (say
why where the result is reported). `--eval-steps N` reads the evals run.sh's EVAL_ALSO_STEPS=N made at N denoising
steps (eval/NAME_sN.json) into OUT/mini_ocr_algorithms_sN.json (mini_ocr_fp8_sN.json).
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from jaxflow_bench.cli import bench_parser
from jaxflow_bench.results import write_result
from jaxflow_bench.summary import metrics_rows

ARMS = {"flowgrpo": "", "guard": "_guard", "corrected": "_corrected", "dropzero": "_dropzero", "cfgfree": "_cfgfree",
        "nft": "_nft",
        "mixgrpo": "_mixgrpo", "mixgrpo_flash": "_mixgrpo_flash", "awm": "_awm", "omni": "_omni",
        "omni_fp8": "_omni_fp8"}
# the eval an arm rises from where it is not the pipeline's eval/before.json (run.sh's BEFORE)
BEFORE = {"_cfgfree": "before_nft", "_nft": "before_nft", "_omni": "before_omni", "_omni_fp8": "before_omni"}
# each result file: its arms and the arm they are paired against
RESULTS = {"mini_ocr_algorithms": (tuple(a for a in ARMS if not a.startswith("omni")), "flowgrpo"),
           "mini_ocr_fp8": (("omni", "omni_fp8"), "omni")}


def eval_tag(eval_steps: int | None) -> tuple[str, str]:
    """(the suffix of the eval files and results at `eval_steps` denoising steps, "" for the evals' own steps; the
    hint a missing one's error ends with)."""
    return (f"_s{eval_steps}", f" with EVAL_ALSO_STEPS={eval_steps}") if eval_steps else ("", "")


EDGE, LATE = 3, 6  # steps averaged at each end of the train reward; the step the late medians start from


def train_dynamics(rows: list[dict]) -> dict:
    """A run's train-side figures from its metrics.jsonl `rows` (none for a metric it does not log)."""
    rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
    figures = {}
    if len(rewards) >= 2 * EDGE:
        figures.update(train_reward_first=statistics.fmean(rewards[:EDGE]),
                       train_reward_last=statistics.fmean(rewards[-EDGE:]))
    for key in ("approx_kl", "clipfrac"):
        late = [r[key] for r in rows if r["step"] >= LATE and key in r]
        if late:
            figures[f"{key}_late"] = statistics.median(late)
    return figures


def run_of(pipeline: Path, suffix: str, before_name: str | None = None, tag: str = "") -> dict | None:
    """One arm's run on one pipeline: before, after, rise, rise_se, steps, minutes; None where it has no eval there.
    It rises from eval/`before_name`.json (default: the arm's `BEFORE`, else before.json); `tag` ("_sN": the evals
    at N steps) is appended to both evals' names."""
    after = pipeline / "eval" / f"after{suffix}{tag}.json"
    if not after.exists():
        return None
    before_name = before_name or BEFORE.get(suffix, "before")
    before, after = (json.loads(p.read_text()) for p in (pipeline / "eval" / f"{before_name}{tag}.json", after))
    if before["n"] != after["n"]:
        raise ValueError(f"{pipeline}: before has {before['n']} prompts and after{suffix} {after['n']}")
    run = pipeline / f"rl{suffix}"
    rows = metrics_rows(run) if (run / "metrics.jsonl").is_file() else []
    if (run / "checkpoints").is_dir():
        steps = max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    else:
        steps = max(r["step"] for r in rows or metrics_rows(run))  # no file: FileNotFoundError, as before
    seconds = [float(line.split()[1]) for line in (pipeline / "timings.txt").read_text().splitlines()
               if line.split()[:1] == [f"rl{suffix}"]]
    if not seconds:
        raise ValueError(f"{pipeline}/timings.txt has no rl{suffix} line: was the run cut?")
    return dict(before=before["mean"], after=after["mean"], rise=after["mean"] - before["mean"],
                rise_se=math.hypot(before["se"], after["se"]), before_name=before_name, before_se=before["se"],
                after_se=after["se"], steps=steps, minutes=seconds[-1] / 60, train=train_dynamics(rows))


def paired_variance(a: dict, b: dict) -> float:
    """The variance of run a's rise minus run b's on one pipeline: their after-evals', and their before-evals' unless
    both rose from the same one (it cancels)."""
    same = a["before_name"] == b["before_name"]
    return a["after_se"] ** 2 + b["after_se"] ** 2 + (0 if same else a["before_se"] ** 2 + b["before_se"] ** 2)


def summarize(runs: dict[str, dict[str, dict]], baseline: str) -> dict:
    """Figures of each arm's runs by pipeline ({arm: {pipeline: run_of(...)}}), paired against `baseline`'s."""
    figures = {}
    for arm, by_pipeline in runs.items():
        if not by_pipeline:
            continue
        n = len(by_pipeline)
        values = list(by_pipeline.values())
        figures.update({f"{arm}/before": sum(r["before"] for r in values) / n,
                        f"{arm}/after": sum(r["after"] for r in values) / n,
                        f"{arm}/rise": sum(r["rise"] for r in values) / n,
                        f"{arm}/rise_se": math.sqrt(sum(r["rise_se"] ** 2 for r in values)) / n,
                        f"{arm}/rise_min": min(r["rise"] for r in values),
                        f"{arm}/steps": sum(r["steps"] for r in values) / n,
                        f"{arm}/minutes": sum(r["minutes"] for r in values) / n, f"{arm}/pipelines": n})
        for key in sorted({k for r in values for k in r["train"]}):
            logged = [r["train"][key] for r in values if key in r["train"]]
            figures[f"{arm}/{key}"] = sum(logged) / len(logged)
        for name, r in by_pipeline.items():
            figures.update({f"{arm}/{name}/rise": r["rise"], f"{arm}/{name}/rise_se": r["rise_se"]})
        base = runs.get(baseline, {})
        shared = [name for name in by_pipeline if name in base]
        if arm != baseline and shared:
            figures[f"{arm}/rise_vs_{baseline}"] = sum(
                by_pipeline[name]["rise"] - base[name]["rise"] for name in shared) / len(shared)
            figures[f"{arm}/rise_vs_{baseline}_se"] = math.sqrt(sum(
                paired_variance(by_pipeline[name], base[name]) for name in shared)) / len(shared)
    return figures


def collect(pipelines: list[Path], exclude: tuple[str, ...] = (), eval_steps: int | None = None) -> dict[str, dict]:
    """{result name: its figures} for each of `RESULTS` whose arms ran on `pipelines` (but the `exclude`d runs); with
    `eval_steps` N, of the evals at N steps, each name with the suffix _sN."""
    tag, hint = eval_tag(eval_steps)
    unknown = [e for e in exclude if e.partition("/")[2] not in ARMS or e.partition("/")[0] not in
               {p.name for p in pipelines}]
    if unknown:
        raise ValueError(f"--exclude {unknown}: name PIPELINE/ARM, a pipeline folder's name and one of {list(ARMS)}")
    results = {}
    for name, (arms, baseline) in RESULTS.items():
        runs = {arm: {p.name: r for p in pipelines
                      if f"{p.name}/{arm}" not in exclude and (r := run_of(p, ARMS[arm], tag=tag))} for arm in arms}
        if figures := summarize(runs, baseline):
            results[name + tag] = figures
    if not results:
        raise ValueError(f"no arm's eval/after*{tag}.json in {[str(p) for p in pipelines]}: "
                         f"run experiments/mini_ocr/run.sh first{hint}")
    return results


def main(argv=None) -> None:
    p = bench_parser(__doc__)
    p.add_argument("--pipelines", type=Path, nargs="+", required=True, help="experiments/mini_ocr/run.sh OUT folders")
    p.add_argument("--exclude", nargs="*", default=(), help="PIPELINE/ARM runs to leave out (known invalid)")
    p.add_argument("--eval-steps", type=int, help="the evals at N denoising steps (run.sh's EVAL_ALSO_STEPS)")
    a = p.parse_args(argv)
    for name, figures in collect(a.pipelines, tuple(a.exclude), a.eval_steps).items():
        print(json.dumps(figures, indent=1), "->", write_result(a.out, name, figures))


if __name__ == "__main__":
    main()
