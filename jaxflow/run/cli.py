"""The command line of `python -m jaxflow.train`: flags, help, the run_dir checks before any heavy work, and input
errors as one line.

Input the user must fix (a flag, a config key or value, a run_dir in use, a resume that does not match its run)
prints `error: ...` naming the fix and exits 2, before any model, device or Ray starts; real failures keep their
traceback. Exit codes (`EXIT_CODES`, README): 0 finished, 1 failed, 2 input to fix, 75 stopped by a signal after
checkpointing (resumable), 130 interrupted at once (a second signal, or one during start-up).
"""
from __future__ import annotations

import ast
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

USAGE = """\
usage: python -m jaxflow.train [--config FILE] [--config.KEY=VALUE ...] [flags]

FlowGRPO LoRA training (README.md). Every output goes under config.run_dir.

  --config FILE           the config, a file with get_config() (default configs/tiny_ocr.py; configs/qwen_ocr.py)
  --config.KEY=VALUE      set one config key, e.g. --config.train.learning_rate=1e-3 --config.run_dir=runs/a
  --print_config          print every config key, its value (after the --config.KEY overrides) and help; exit
  --resume                continue the run in config.run_dir from its newest checkpoint that restores
  --allow_config_changes  with --resume: train on although keys that change the training differ from the run's
  --overwrite             delete a previous run's outputs in config.run_dir, then start a new run there
  --verbose               show the libraries' INFO logs (orbax, JAX, Ray), silenced by default

Exit codes: 0 finished (also a run that eval.stop_after ended early); 1 failed; 2 a flag, config value or run_dir
to fix (nothing ran); 75 stopped by SIGINT/SIGTERM after checkpointing its last step (continue with --resume); 130
interrupted at once (a second signal, or one during start-up), the checkpoints as they were.
"""
HELP_FLAGS = ("-h", "-help", "--help", "--helpshort", "--helpfull", "-?")
EXIT_CODES = {"finished": 0, "failed": 1, "input": 2, "stopped": 75, "interrupted": 130}
VALUE_COLUMN = 24  # --print_config: the widest value that sets where the help column starts


def _define_flags():
    """The flags; ml_collections parses the --config.KEY overrides of sys.argv already here."""
    from absl import flags
    from ml_collections import config_flags
    default = Path(__file__).resolve().parents[2] / "configs" / "tiny_ocr.py"  # not relative to the cwd
    config_flags.DEFINE_config_file("config", str(default), "training config file (get_config())")
    flags.DEFINE_bool("print_config", False, "print every config key with its value and help, and exit")
    flags.DEFINE_bool("resume", False, "continue from the newest checkpoint in config.run_dir that restores")
    flags.DEFINE_bool("allow_config_changes", False, "with --resume: accept a config that changes the training")
    flags.DEFINE_bool("overwrite", False, "delete a previous run's outputs in config.run_dir first")
    flags.DEFINE_bool("verbose", False, "show the libraries' INFO logs")
    return flags.FLAGS


def _unquote(text: str) -> str:
    """ml_collections nests repr()s of its KeyError in the message: undo them."""
    while len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":
        try:
            text = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            break
    return text


def flag_error(exc: Exception, argv: list[str]) -> str:
    """One line for an error raised while the flags (and the config file) are read."""
    from absl import flags
    if isinstance(exc, (KeyError, AttributeError)):  # a --config.KEY that the config lacks
        name, *hint = _unquote(str(exc)).split("\n")
        name = _unquote(name)
        given = next((a.split("=")[0] for a in argv if re.search(rf"^--config\..*\b{re.escape(name)}\b", a)), name)
        return (f"{given}: the config has no key {name!r}" + (f"; {' '.join(hint)}" if hint else "") +
                "; list the keys with --print_config")
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if isinstance(exc, OSError):  # the --config file itself
        return f"--config: cannot load the config file ({lines[-1] if lines else exc})"
    text = " ".join(lines)
    boolean = re.search(r"flag (--[\w.]+)=(.*?): \('Non-boolean argument to boolean flag', '.*'\)", text)
    if boolean:  # absl shows a raw tuple here
        return f"{boolean.group(1)}: {boolean.group(2)!r} is not a bool; pass True or False"
    suffix = "; see --help" if isinstance(exc, flags.Error) else ""
    return text + suffix


def config_file_arg(argv: list[str]) -> str:
    """The --config FILE of `argv` (the last one given; `--config=F`, `--config F`), else the default."""
    path = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_ocr.py")
    for i, arg in enumerate(argv[1:], start=1):
        name, eq, value = arg.partition("=")
        if name in ("--config", "-config"):
            path = value if eq else (argv[i + 1] if i + 1 < len(argv) else path)
    return path


def config_file_error(argv: list[str]) -> str | None:
    """One line for a --config file that does not give a config: it does not compile or import (FILE:LINE and the
    error), has no get_config(), or get_config() returns something else than a ConfigDict; None when it gives one
    (or cannot be read: flag_error names that). The file is run here once before ml_collections runs it."""
    import importlib.machinery
    import importlib.util
    import traceback

    from ml_collections import ConfigDict
    path, *args = config_file_arg(argv).split(":", 1)
    if not os.path.isfile(path):
        return None
    where = path
    try:
        loader = importlib.machinery.SourceFileLoader("config_file", path)  # as ml_collections loads it
        module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
        loader.exec_module(module)
        if not callable(getattr(module, "get_config", None)):
            return f"--config: {path} has no get_config(): define get_config() returning a ConfigDict"
        where = f"{path}'s get_config()"
        config = module.get_config(*args)
    except SyntaxError as exc:
        return f"--config: {exc.filename or path}:{exc.lineno}: {type(exc).__name__}: {exc.msg}"
    except Exception as exc:  # noqa: BLE001 - anything the user's file raises, at its line
        lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__)
                 if os.path.exists(f.filename) and os.path.samefile(f.filename, path)]
        at = f"{path}:{lines[-1]}" if lines else where
        message = (str(exc).strip().splitlines() or [""])[0]
        return f"--config: {at}: {type(exc).__name__}: {message}"
    if not isinstance(config, ConfigDict):
        return f"--config: {path}: get_config() returned {type(config).__name__}, not a ConfigDict"
    return None


def print_config(cfg) -> None:
    """One line per key in the config's order: `key = value  # help` (jaxflow/config/recipes.py HELP), the columns aligned;
    a value longer than VALUE_COLUMN pushes its help along rather than widening the column for all."""
    from jaxflow.config.recipes import HELP, config_keys, config_value
    keys = config_keys(cfg)
    values = [repr(config_value(cfg, key)) for key in keys]
    key_width = max(map(len, keys), default=0)
    value_width = max((len(v) for v in values if len(v) <= VALUE_COLUMN), default=0)
    for key, value in zip(keys, values):
        line = f"{key:<{key_width}} = {value}"
        if key in HELP:
            line = f"{line:<{key_width + 3 + value_width}}  # {HELP[key]}"
        print(line)


def main(trainer_class, argv: list[str] | None = None) -> int:
    """Run the command line; `trainer_class` is the loop (`jaxflow.train.Trainer`), passed in by the entry so that
    this module never imports it."""
    argv = list(sys.argv if argv is None else argv)
    if any(a in HELP_FLAGS for a in argv[1:]):
        print(USAGE)
        return 0
    from jaxflow.run import signals
    signals.install()  # a signal from here until the training loop: exit 130 at once (jaxflow/run/signals.py)
    from absl import flags
    problem = config_file_error(argv)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_CODES["input"]
    try:
        FLAGS = _define_flags()
        extra = FLAGS(argv)[1:]
        cfg = FLAGS.config
        cfg.keys()  # a config file that failed to load raises here
    except (flags.Error, KeyError, AttributeError, OSError, ValueError) as exc:
        print(f"error: {flag_error(exc, argv)}", file=sys.stderr)
        return 2
    if extra:
        print(f"error: unexpected argument {extra[0]!r}: flags only (a config file is --config FILE); see --help",
              file=sys.stderr)
        return 2
    configure_logging(FLAGS.verbose)
    if FLAGS.print_config:
        print_config(cfg)
        return 0
    from jaxflow.config import validation as config_lib
    from jaxflow.run import run_dir as run_dir_lib
    from jaxflow.trainer.divergence import Diverged, RolloutNotFinite
    from jaxflow.trainer.logp_gate import GateTripped
    from jaxflow.trainer.memory import PoolLargerThanPlanned
    from jaxflow.sync.verify import SyncMismatch
    from jaxflow.run.rollout_client import EngineDidNotStart, EngineOutOfMemory, RolloutDied
    signals.install(f"error: interrupted; the checkpoints in {Path(cfg.run_dir) / 'checkpoints'} are as they were "
                    f"(continue with --resume if there are any)", unwind=True)
    ray_logs = None  # Ray's log folder, once Ray started
    try:
        config = config_lib.validate(cfg)  # the one validation of this process: the trainer takes its result
        from jaxflow.config.machine import before_jax, compilation_cache, resolve_layout
        config, chosen = resolve_layout(config, resume=FLAGS.resume)  # rollout.layout='auto', once
        finished = run_dir_lib.preflight(config, resume=FLAGS.resume, overwrite=FLAGS.overwrite,
                                         allow_config_changes=FLAGS.allow_config_changes)
        if finished:
            print(finished)
            return 0
        machine = before_jax(config, chosen)  # JAX's share of each GPU, set before JAX starts
        compilation_cache(config.train.compile_cache)
        began = time.monotonic()
        ray_logs = _start_ray(config, FLAGS.verbose)
        before = {"Ray": time.monotonic() - began} if ray_logs is not None else {}  # the start-up line's first phase
        trainer = trainer_class(config, resume=FLAGS.resume)
        if trainer.driver:
            print(f"training {Path(cfg.run_dir).resolve()}: step {trainer.start} -> {cfg.train.num_steps}", flush=True)
            print(trainer.plan.summary(), flush=True)  # the plan, logged once
            if machine:
                print(machine, flush=True)
            print(trainer.startup_line(before), flush=True)
            if trainer.memory_summary:
                print(trainer.memory_summary, flush=True)
        try:
            result = trainer.run()
        finally:
            trainer.close()
    except config_lib.UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CODES["input"]
    except (Diverged, RolloutNotFinite, GateTripped, PoolLargerThanPlanned) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CODES["failed"]
    except SyncMismatch as exc:  # raised in the step's sync, before its checkpoint
        print(f"error: {exc}; the checkpoints in {Path(cfg.run_dir) / 'checkpoints'} are as they were",
              file=sys.stderr)
        return EXIT_CODES["failed"]
    except EngineOutOfMemory as exc:  # not retried: a fresh engine would run out again
        print(f"error: {engine_out_of_memory(exc, config, Path(cfg.run_dir))}", file=sys.stderr)
        return EXIT_CODES["failed"]
    except EngineDidNotStart as exc:  # not retried: the same folder, memory and config fail the same way
        print(f"error: {engine_did_not_start(exc, config, ray_logs)}", file=sys.stderr)
        return EXIT_CODES["failed"]
    except RolloutDied as exc:  # died on every retry
        print(f"error: {exc}; {_worker_logs(ray_logs)}; the checkpoints in {Path(cfg.run_dir) / 'checkpoints'} are "
              f"as they were (continue with --resume if there are any)", file=sys.stderr)
        return EXIT_CODES["failed"]
    except KeyboardInterrupt:  # in start-up (signals.Interrupted) or a second signal in the loop
        signals.exit_now(EXIT_CODES["interrupted"], release=_stop_ray)
    except Exception as exc:  # noqa: BLE001 - out of memory in the loop is one line; anything else re-raised
        if signals.raised():  # the start-up interrupt, swallowed by a library and raised again as another error
            signals.exit_now(EXIT_CODES["interrupted"], release=_stop_ray)
        line = disk_full(exc, Path(cfg.run_dir)) or out_of_memory(exc, Path(cfg.run_dir))
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return EXIT_CODES["failed"]
    history = result["history"]
    if trainer.driver:
        step = history[-1]["step"] if history else trainer.start
        skipped = [row["step"] for row in history if row.get("skipped")]
        print(run_dir_lib.summary(Path(cfg.run_dir), step, cfg.train.num_steps, ray_logs, skipped), flush=True)
    if result.get("stopped"):
        saved = result["checkpoint"]  # None: its only step skipped an update, so none was written
        print(f"stopped by a signal after checkpointing step {saved}: exit code {EXIT_CODES['stopped']}; --resume "
              f"continues" if saved else f"stopped by a signal before any checkpoint: exit code "
              f"{EXIT_CODES['stopped']}; start again with --overwrite", flush=True)
        return EXIT_CODES["stopped"]
    if result.get("early_stop") and trainer.driver:  # eval.stop_after: a normal end, exit 0 (jaxflow/run/gold.py)
        print(f"stopped early: {result['early_stop']}: exit code {EXIT_CODES['finished']}", flush=True)
    return EXIT_CODES["finished"]


def disk_full(exc: BaseException, run_dir: Path) -> str | None:
    """One line for a write that found its filesystem full (a checkpoint, the metrics; also when closing the logs
    failed after it), or None for any other error: where, the space left there, and that the checkpoints before are
    intact (a checkpoint is renamed to its step only once complete)."""
    from jaxflow.trainer.checkpoint import no_space
    from jaxflow.run.run_dir import checkpoint_steps
    err = no_space(exc)
    if err is None:
        return None
    where = Path(getattr(err, "filename", None) or run_dir)
    what = err.strerror if isinstance(err, OSError) and err.strerror else "no space left on device"
    folder = next(p for p in (where, *where.parents) if p.exists())
    steps = checkpoint_steps(run_dir)
    kept = f"newest: step {steps[0]}" if steps else "none written yet"
    return (f"{what} in {where} ({_size(shutil.disk_usage(folder).free)} free there); the checkpoints in "
            f"{run_dir / 'checkpoints'} are intact ({kept}): free space, then continue with --resume")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def out_of_memory(exc: BaseException, run_dir: Path) -> str | None:
    """One line for a device running out of memory inside the loop (XLA's RESOURCE_EXHAUSTED, torch's CUDA out of
    memory, also from a rollout actor), or None for any other error. The run stops without writing: its newest
    checkpoint is as it was."""
    text = f"{type(exc).__name__}: {exc}"
    first = next((ln.strip() for ln in text.splitlines()
                  if "RESOURCE_EXHAUSTED" in ln or "out of memory" in ln.lower()), None)
    if first is None:
        return None
    where = run_dir / "checkpoints"
    return (f"out of device memory in the training loop ({first[:240]}); the checkpoints in {where} are as they were: "
            f"lower the memory (train.num_micro_batches, XLA_CLIENT_MEM_FRACTION, model.remat) and continue with "
            f"--resume")


def engine_out_of_memory(exc: BaseException, config, run_dir: Path) -> str:
    """One line for a rollout engine out of memory (`EngineOutOfMemory`): its error, the checkpoints as they were,
    and the knobs that lower the engine's memory with their values now."""
    s, r = config.sample, config.rollout
    smaller = [d for d in range(1, s.prompts_per_call) if s.prompts_per_step % d == 0]
    knobs = [f"--config.sample.prompts_per_call={smaller[-1]} (now {s.prompts_per_call}: fewer prompts per engine "
             f"request)" if smaller else "a smaller sample.group_size or image (sample.height, sample.width): "
             "prompts_per_call is 1 already"]
    if r.engine == "vllm_omni" and r.bagel_deploy == "two_stage":
        knobs.append(f"rollout.thinker_memory (the thinker's share of the GPU, now {r.thinker_memory or 0.45})")
    if _shares_gpus(r):
        knobs.append(f"a smaller JAX share of each GPU, XLA_CLIENT_MEM_FRACTION (now {_jax_share()}), or "
                     f"--config.rollout.layout=split (engines on GPUs of their own)")
    return (f"the rollout engine ran out of memory ({exc}); the checkpoints in {run_dir / 'checkpoints'} are as they "
            f"were: lower the engine's memory with {'; '.join(knobs)}, and continue with --resume")


def engine_did_not_start(exc: BaseException, config, ray_logs: str | None) -> str:
    """One line for a rollout engine whose actor died in its creation (`EngineDidNotStart`: the engine, its device and
    its error's last line): where the worker's own log is, and, where the engine shares its GPUs with JAX's pool, the
    knobs for the usual cause (too little GPU memory left to the engine)."""
    line = f"{exc}; {_worker_logs(ray_logs)}: look there for the worker's error"
    if _shares_gpus(config.rollout):
        line += (f" (out of GPU memory: lower JAX's share of each GPU, XLA_CLIENT_MEM_FRACTION (now {_jax_share()}), "
                 f"or use --config.rollout.layout=split: engines on GPUs of their own)")
    return line


def _worker_logs(ray_logs: str | None) -> str:
    """Where the rollout actors' own output is: Ray's log folder of this run, when it is known."""
    return f"its own log is under {ray_logs} (worker-*.err)" if ray_logs else \
        "its own log is in Ray's log folder (worker-*.err)"


def _shares_gpus(rollout) -> bool:
    """Whether the rollout's engines share their GPUs with JAX's pool."""
    return rollout.layout != "split" and str(rollout.device).startswith("cuda")


def _jax_share() -> str:
    """JAX's share of each GPU as the environment sets it, or 'unset'."""
    return os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION") or os.environ.get("XLA_CLIENT_MEM_FRACTION") or "unset"


def configure_logging(verbose: bool) -> None:
    """Warnings and errors only, one plain line each, unless `verbose` (orbax logs ~45 INFO lines per checkpoint)."""
    import logging

    from absl import logging as absl_logging
    level = logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        force=True)
    absl_logging.set_verbosity("info" if verbose else "warning")


def _start_ray(cfg, verbose: bool) -> str | None:
    """Start (or join) Ray before JAX starts its threads (Ray's start forks); returns Ray's log folder.

    A local cluster gets Ray's own default, token authentication, stated in RAY_AUTH_MODE: left unset, Ray warns
    on every start that it chose it."""
    from jaxflow.run.run_dir import first_process
    if cfg.rollout.layout == "in_process" or not first_process():
        return None
    if not cfg.rollout.address:
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    from jaxflow.run import signals
    from jaxflow.run.rollout_client import init_ray
    if cfg.log.progress:
        print("start-up: Ray ...", flush=True)
    try:
        init_ray(cfg.rollout.address, verbose)
    except SystemExit:  # a SIGTERM that ray.init's own handler took (sys.exit): an interrupt all the same
        raise signals.Interrupted(signal.SIGTERM) from None
    finally:
        signals.install()  # ray.init replaced the SIGTERM handler (Python's, and its core worker's C++ one)
    import ray
    context = ray.get_runtime_context()  # Ray keeps a session's logs in TEMP_DIR/SESSION/logs
    return os.path.join(context.get_temp_dir(), context.get_session_name(), "logs")


def _stop_ray() -> None:
    """Release Ray on an interrupt: the rollout actors, and the local instance if this process started it."""
    if "ray" in sys.modules:
        import ray
        if ray.is_initialized():
            ray.shutdown()
