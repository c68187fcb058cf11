"""The command line of `python -m jaxflow.train`: flags, help, the run_dir checks before any heavy work, and input
errors as one line.

Input the user must fix (a flag, a config key or value, a run_dir in use, a resume that does not match its run)
prints `error: ...` naming the fix and exits 2, before any model, device or Ray starts; real failures keep their
traceback.
"""
from __future__ import annotations

import ast
import re
import sys

USAGE = """\
usage: python -m jaxflow.train [--config FILE] [--config.KEY=VALUE ...] [flags]

FlowGRPO LoRA training (README.md). Every output goes under config.run_dir.

  --config FILE           the config, a file with get_config() (default configs/tiny_ocr.py; configs/qwen_ocr.py)
  --config.KEY=VALUE      set one config key, e.g. --config.train.learning_rate=1e-3 --config.run_dir=runs/a
  --print_config          print every config key with its value (after the --config.KEY overrides) and exit
  --resume                continue the run in config.run_dir from its newest checkpoint that restores
  --allow_config_changes  with --resume: train on although keys that change the training differ from the run's
  --overwrite             delete a previous run's outputs in config.run_dir, then start a new run there
"""
HELP_FLAGS = ("-h", "-help", "--help", "--helpshort", "--helpfull", "-?")


def _define_flags():
    """The flags; ml_collections parses the --config.KEY overrides of sys.argv already here."""
    from absl import flags
    from ml_collections import config_flags
    config_flags.DEFINE_config_file("config", "configs/tiny_ocr.py", "training config file (get_config())")
    flags.DEFINE_bool("print_config", False, "print every config key with its value and exit")
    flags.DEFINE_bool("resume", False, "continue from the newest checkpoint in config.run_dir that restores")
    flags.DEFINE_bool("allow_config_changes", False, "with --resume: accept a config that changes the training")
    flags.DEFINE_bool("overwrite", False, "delete a previous run's outputs in config.run_dir first")
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
    suffix = "; see --help" if isinstance(exc, flags.Error) else ""
    return " ".join(lines) + suffix


def print_config(cfg) -> None:
    from jaxflow.run_dir import flatten
    for key, value in sorted(flatten(cfg.to_dict()).items()):
        print(f"--config.{key}={value!r}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    if any(a in HELP_FLAGS for a in argv[1:]):
        print(USAGE)
        return 0
    from absl import flags
    try:
        FLAGS = _define_flags()
        FLAGS(argv)
        cfg = FLAGS.config
        cfg.keys()  # a config file that failed to load raises here
    except (flags.Error, KeyError, AttributeError, OSError, ValueError) as exc:
        print(f"error: {flag_error(exc, argv)}", file=sys.stderr)
        return 2
    if FLAGS.print_config:
        print_config(cfg)
        return 0
    from jaxflow import config as config_lib
    from jaxflow import run_dir as run_dir_lib
    try:
        config_lib.validate(cfg)
        finished = run_dir_lib.preflight(cfg, resume=FLAGS.resume, overwrite=FLAGS.overwrite,
                                         allow_config_changes=FLAGS.allow_config_changes)
        if finished:
            print(finished)
            return 0
        from jaxflow.train import Trainer
        trainer = Trainer(cfg, resume=FLAGS.resume)
        try:
            trainer.run()
        finally:
            trainer.close()
    except config_lib.UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
