"""The trust benchmark: what the run's own checks cost and catch, on the recipe (vLLM-Omni engine, one GPU).

    python -m jaxflow_bench.trust OUT [--steps 5] [--parts healthy repeat stale kill] [--stale-from 2]
        [--kill-after 2] [--reward brightness] [--config FILE --device cpu] [--config.x=y ...]

Each part is one `jaxflow_bench.e2e` 1gpu run (its set-up: the recipe at 2 prompts a step, no eval or checkpoints)
into OUT/PART, so the parts can be split over several device commands (--parts) into one OUT. The runs train on
--reward (brightness): on random weights' images the recipe's OCR scores every sample 0, so no sample has an
advantage, the LoRA never moves and every version is the same adapter: the checks would have nothing to see. A
healthy, repeat or stale run whose LoRA did not move (grad_norm 0 at every step before the fault) fails its part.
  healthy  --steps steps: sync_verify_s (median over steps), the log-prob gate's per-step p99 (its p99 and max);
  repeat   the same run again: the run-to-run spread of reward_mean and loss (largest |a - b| over steps);
  stale    train.sync_fault_from=--stale-from (the engine is sent the previous version's LoRA from that version on):
           the step the sync check stops the run at (exit 1), against the version the fault starts at;
  kill     the engine's actor process killed (SIGKILL) mid-rollout of the step after --kill-after: the retry on a
           fresh actor, as the killed step's seconds over the median of the other steps after the first, the
           retries the run logged, and no mixed versions: every step's samples from one policy, the step's own
           (metrics `rollout/versions` 1, `staleness` 0; a run that shows otherwise fails the part).
Then OUT/trust_gpu.json gets the figures of every part found in OUT (a part not run yet is left out).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

from jaxflow_bench import e2e
from jaxflow_bench.cli import parse_with_overrides
from jaxflow_bench.results import write_result

PARTS = ("healthy", "repeat", "stale", "kill")
STOP_LINE = "error: LoRA sync check:"
RETRY_LINE = "rollout actor died"  # jaxflow.run.rollout_client's warning before it restarts the actors and retries


def rows(part_dir: Path) -> list[dict]:
    path = part_dir / "run" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def mixed_steps(part_rows: list[dict]) -> list[int]:
    """The steps whose samples did not all come from the step's own policy (`rollout/versions` 1, `staleness` 0)."""
    return [r["step"] for r in part_rows if r.get("rollout/versions") != 1 or r.get("staleness", 0) != 0]


def moved(part_rows: list[dict], before: int | None = None) -> bool:
    """Whether the LoRA changed in the run: a step (before step `before`, when given) with a nonzero grad_norm."""
    return any(r.get("grad_norm", 0) for r in part_rows if before is None or r["step"] < before)


def _mean(value) -> float:
    return float(np.mean(value))


def figures(out: Path) -> dict:
    """The figures of the parts run into `out` (each OUT/PART with its run and part.json)."""
    done = {p: json.loads((out / p / "part.json").read_text()) for p in PARTS if (out / p / "part.json").is_file()}
    f = {}
    if "healthy" in done:
        healthy = rows(out / "healthy")
        f["sync_verify_s"] = statistics.median(r["sync_verify_s"] for r in healthy)
        p99 = [r["logp_mismatch_p99"] for r in healthy if r.get("logp_mismatch_rows")]
        f.update(logp_mismatch_p99_p99=float(np.percentile(p99, 99)), logp_mismatch_p99_max=max(p99),
                 logp_mismatch_max=max(r["logp_mismatch_max"] for r in healthy if r.get("logp_mismatch_rows")),
                 sync_mismatches=healthy[-1]["sync_mismatches"], healthy_steps=len(healthy))
        if "repeat" in done:
            again = rows(out / "repeat")
            pairs = list(zip(healthy, again))
            f["reward_spread_max"] = max(abs(_mean(a["reward_mean"]) - _mean(b["reward_mean"])) for a, b in pairs)
            f["loss_spread_max"] = max(abs(_mean(a["loss"]) - _mean(b["loss"])) for a, b in pairs)
            f["spread_steps"] = len(pairs)
    if "stale" in done:
        s = done["stale"]
        f.update(stale_from=s["stale_from"], stale_exit=s["rc"],
                 stale_caught_step=len(rows(out / "stale")) + 1 if s["stopped_by_check"] else None)
    if "kill" in done and done["kill"]["killed_step"] is not None:
        steps = {r["step"]: r["time/step"] for r in rows(out / "kill")}
        killed = done["kill"]["killed_step"]
        others = [t for s, t in steps.items() if s not in (1, killed)]
        if killed in steps and others:
            f["actor_kill_recovery_s"] = steps[killed] - statistics.median(others)
            f["actor_kill_step"] = killed
            f["actor_kill_retries"] = done["kill"]["retries"]
            f["actor_kill_mixed_steps"] = mixed_steps(rows(out / "kill"))
    return f


def engine_pids(root: int) -> list[int]:
    """The rollout actors' processes (Ray titles them ray::RolloutServer...) among `root`'s descendants."""
    parents, titles = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            titles[int(entry.name)] = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        children = [c for c, p in parents.items() if p == pid]
        frontier += children
        found += [c for c in children if titles.get(c, "").startswith("ray::RolloutServer")]
    return found


class Killer(threading.Thread):
    """Kills the engine's actor once `after` steps are logged, `delay` seconds into the next (its rollout)."""

    def __init__(self, metrics: Path, after: int, delay: float):
        super().__init__(daemon=True)
        self.metrics, self.after, self.delay, self.killed_step, self.done = metrics, after, delay, None, False

    def run(self):
        while not self.done:
            logged = self.metrics.read_text().count("\n") if self.metrics.is_file() else 0
            if logged >= self.after:
                time.sleep(self.delay)
                pids = engine_pids(os.getpid())
                if pids:
                    os.kill(pids[0], signal.SIGKILL)
                    self.killed_step = self.after + 1
                return
            time.sleep(0.2)


def run_part(args, part: str, overrides: list[str]) -> dict:
    """One part's run into OUT/PART; its record (also written as OUT/PART/part.json)."""
    out = Path(args.out) / part
    given = ["--layout", "1gpu", "--steps", str(args.steps), "--reward", args.reward,
             *(["--config", args.config] if args.config else []),
             *(["--device", args.device] if args.device else [])]
    e2e_args = e2e.parser().parse_args([str(out), *given])
    cmd, env, _, watched = e2e.setup(e2e_args, dict(os.environ))
    out.mkdir(parents=True, exist_ok=True)
    e2e.ensure_model(e2e_args, env)
    extra = [f"--config.train.sync_fault_from={args.stale_from}"] if part == "stale" else []
    killer = Killer(out / "run" / "metrics.jsonl", args.kill_after, args.kill_delay) if part == "kill" else None
    if killer:
        killer.start()
    rc = e2e.run_logged([*cmd, *overrides, *extra], env, out, watched)
    if killer:
        killer.done = True
    log = (out / "train.log").read_text(errors="replace") if (out / "train.log").is_file() else ""
    record = {"part": part, "rc": rc, "steps": args.steps, "stopped_by_check": STOP_LINE in log,
              "stale_from": args.stale_from if part == "stale" else None,
              "killed_step": killer.killed_step if killer else None, "retries": log.count(RETRY_LINE)}
    (out / "part.json").write_text(json.dumps(record) + "\n")
    if part != "stale" and rc:
        raise RuntimeError(f"the {part} run failed (exit {rc}): see {out / 'train.log'}")
    if part != "kill" and not moved(rows(out), args.stale_from if part == "stale" else None):
        when = " before the fault" if part == "stale" else ""
        raise RuntimeError(f"the {part} run's LoRA did not move (grad_norm 0 at every step{when}): --reward "
                           f"{args.reward} gave every sample of a group the same score; train on a reward that varies")
    if part == "stale" and not record["stopped_by_check"]:
        raise RuntimeError(f"the sync check did not stop the stale run (exit {rc}; the engine was sent the previous "
                           f"version's LoRA from version {args.stale_from} on): see {out / 'train.log'}")
    if part == "kill" and (mixed := mixed_steps(rows(out))):
        raise RuntimeError(f"the kill run shows mixed or stale policy versions at steps {mixed}: see "
                           f"{out / 'run' / 'metrics.jsonl'}")
    return record


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], usage=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=5, help="steps of each run (default 5)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--stale-from", type=int, default=2, help="the version the stale engine starts at, >= 1")
    p.add_argument("--kill-after", type=int, default=2, help="steps logged before the engine is killed, >= 1")
    p.add_argument("--kill-delay", type=float, default=2.0, help="seconds into the next step (its rollout)")
    p.add_argument("--reward", default="brightness", help="the one reward the runs train on (default brightness: "
                   "it varies on random weights' images)")
    p.add_argument("--config", help="a recipe config of its own model instead (e.g. configs/tiny_ocr.py)")
    p.add_argument("--device", choices=("cuda", "cpu"))
    return p


def main(argv=None) -> int:
    p = parser()
    args, overrides = parse_with_overrides(p, argv)
    if not 1 <= args.stale_from <= args.steps or not 1 <= args.kill_after < args.steps:
        p.error(f"--stale-from {args.stale_from} must be in [1, --steps {args.steps}] and --kill-after "
                f"{args.kill_after} in [1, --steps)")
    try:
        for part in args.parts:
            run_part(args, part, overrides)
    except e2e.Refused as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(write_result(args.out, "trust_gpu", figures(Path(args.out))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
