"""Which micro-batch of the recipe's train step fits one GPU beside the rollout engine: XLA's memory analysis of the
step compiled at each micro-batch size (the check every run makes before its first rollout, jaxflow/trainer/memory.py)
against JAX's pool, at full size with random weights; no rollout runs. Writes OUT/fit_micro_batch.json.

    XLA_PYTHON_CLIENT_PREALLOCATE=true XLA_CLIENT_MEM_FRACTION=0.55 \
      python3 scripts/fit_micro_batch.py --out OUT --model DIR [--prompts 2] [--sizes 8 4 2]

DIR: a full-size pipeline folder (scripts/make_random_pipeline.py --no-transformer-weights).
"""
from __future__ import annotations

import time
from pathlib import Path

from jaxflow.config import sections
from jaxflow.config.validation import config_module
from jaxflow_bench.cli import bench_parser
from jaxflow_bench.results import write_result

ROOT = Path(__file__).resolve().parents[1]


def recipe(model: str, prompts: int):
    cfg = config_module(ROOT / "configs" / "qwen_ocr.py").get_config()
    cfg.model.update(path=model, init="random")
    cfg.sample.update(prompts_per_step=prompts, prompts_per_call=min(4, prompts))
    return sections.build(cfg)  # typed as the trainer reads it (the random-weight model folder is not checked)


def main(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", type=int, default=2, help="sample.prompts_per_step")
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 4, 2], help="samples per micro-batch to try")
    args = p.parse_args(argv)
    from jaxflow.trainer import memory
    from jaxflow.trainer.learner import Learner

    cfg = recipe(args.model, args.prompts)
    t = time.perf_counter()
    learner = Learner(cfg, Path(args.model))
    print(f"model built in {time.perf_counter() - t:.1f} s", flush=True)
    limit, in_use = memory.pool()
    per_update = cfg.sample.prompts_per_step * cfg.sample.group_size // cfg.train.num_mini_batches
    figures, rows = {"pool_gib": limit / memory.GIB, "in_use_gib": in_use / memory.GIB}, []
    for size in args.sizes:
        t = time.perf_counter()
        plans, resident = learner.memory_plans(num_micro_batches=per_update // size)
        worst = max(plans, key=lambda q: q.need(resident))
        need = worst.need(resident)
        fits = need <= limit - in_use
        rows.append((size, worst.name, need / memory.GIB, worst.temp / memory.GIB, fits, time.perf_counter() - t))
        figures.update({f"need_gib_mb{size}": need / memory.GIB, f"temp_gib_mb{size}": worst.temp / memory.GIB,
                        f"fits_mb{size}": fits})
    fitting = [size for size, *_, fits, _ in rows if fits]
    figures["largest_fitting_micro_batch"] = max(fitting) if fitting else 0
    print(f"JAX pool {limit / memory.GIB:.1f} GiB, {in_use / memory.GIB:.1f} GiB in use (frozen weights, LoRA)")
    print(f"{'micro':>5s} {'worst':>12s} {'need GiB':>9s} {'temp GiB':>9s} {'fits':>5s} {'compile s':>9s}")
    for size, name, need, temp, fits, sec in rows:
        print(f"{size:5d} {name:>12s} {need:9.1f} {temp:9.1f} {str(fits):>5s} {sec:9.1f}")
    print(write_result(args.out, "fit_micro_batch", figures))


if __name__ == "__main__":
    main()
