"""Throughput and phase breakdown of a training run from its metrics.jsonl (steps after the first: compile).

    python scripts/summarize_run.py RUN_DIR [--gpus N]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--skip", type=int, default=1, help="leading steps to leave out (compile)")
    args = p.parse_args(argv)
    rows = [json.loads(line) for line in (args.run_dir / "metrics.jsonl").read_text().splitlines()]
    print(f"{'step':>4s} {'rollout':>8s} {'reward':>7s} {'train':>7s} {'sync':>6s} {'wall':>7s} {'img/GPU/s':>9s} "
          f"{'logp_diff_max':>13s}")
    for r in rows:
        total = r["time/step"]  # wall time of the step: the phases and everything between them
        diff = max(v for k, v in r.items() if k.startswith("logp_diff_max/"))
        print(f"{r['step']:4d} {r['time/rollout']:8.1f} {r['time/reward']:7.1f} {r['time/train']:7.1f} "
              f"{r['time/sync']:6.1f} {total:7.1f} {r['images_per_s'] / args.gpus:9.3f} {diff:13.2e}")
    steady = rows[args.skip:]
    if steady:
        med = statistics.median(r["images_per_s"] for r in steady) / args.gpus
        print(f"median over steps {steady[0]['step']}..{steady[-1]['step']}: {med:.3f} img/GPU/s")


if __name__ == "__main__":
    main()
