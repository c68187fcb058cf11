"""`python -m jaxflow.plan --config FILE [--config.KEY=VALUE ...] [--gpus N] [--gpu-memory GiB]`: the machine plan
(jaxflow/config/machine.py, jaxflow/config/planner.py) for the config, the block every run prints at its start
(rollout.layout='auto' resolved first, as the run resolves it, on the line before); exit
2 with one `error:` line when the config cannot fit. The GPUs are nvidia-smi's unless --gpus / --gpu-memory say
otherwise. Nothing starts: no JAX device, no engine."""
from __future__ import annotations

import sys

from jaxflow.config import planner
from jaxflow.config.errors import UserError


def main(argv: list[str] | None = None) -> int:
    from absl import flags
    from ml_collections import config_flags

    from jaxflow.config import validation
    from jaxflow.config.machine import machine_plan, resolve_layout
    from jaxflow.run import cli
    argv = list(sys.argv if argv is None else argv)
    problem = cli.config_file_error(argv)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", cli.config_file_arg(argv), "the config file", flag_values=fv)
    flags.DEFINE_integer("gpus", None, "GPUs to plan for (default: nvidia-smi's)", flag_values=fv)
    flags.DEFINE_float("gpu_memory", None, "GiB of each GPU (default: nvidia-smi's)", flag_values=fv)
    try:
        fv([a.replace("--gpu-memory", "--gpu_memory", 1) for a in argv])
        cfg = fv.config
        cfg.keys()
    except (flags.Error, KeyError, AttributeError, OSError, ValueError) as exc:
        print(f"error: {cli.flag_error(exc, argv)}", file=sys.stderr)
        return 2
    try:
        config, chosen = resolve_layout(validation.validate(cfg), fv.gpus, fv.gpu_memory)
        plan = machine_plan(config, fv.gpus, fv.gpu_memory)
    except (UserError, planner.NoFit) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if plan is None:
        print("error: no GPU found (nvidia-smi): pass --gpu-memory GiB (and --gpus N) to plan for one",
              file=sys.stderr)
        return 2
    print("\n".join(line for line in (chosen, plan.summary()) if line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
