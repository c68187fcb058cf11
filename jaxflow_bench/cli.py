"""The command line every benchmark script shares: its docstring's first line as the description, `--out DIR` (where
its result file NAME.json and logs go) and, for scripts with a CPU code-path check, `--tiny`; for scripts that run
the trainer, its --config.x=y overrides passed through (`parse_with_overrides`)."""
from __future__ import annotations

import argparse
from pathlib import Path

TINY_HELP = "tiny shapes on the CPU (a code-path check)"


def bench_parser(doc: str, tiny: bool = False, tiny_help: str = TINY_HELP) -> argparse.ArgumentParser:
    """An ArgumentParser with --out (required) and, with `tiny`, --tiny; the script adds its own options."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the result file and logs")
    if tiny:
        p.add_argument("--tiny", action="store_true", help=tiny_help)
    return p


def parse_with_overrides(p: argparse.ArgumentParser, argv=None) -> tuple[argparse.Namespace, list[str]]:
    """(the parsed arguments, the trainer's --config.x=y overrides among the rest); any other argument is a usage
    error (exit 2)."""
    args, overrides = p.parse_known_args(argv)
    if bad := [a for a in overrides if not a.startswith("--config.")]:
        p.error(f"unrecognized arguments: {' '.join(bad)} (the trainer's overrides are --config.x=y)")
    return args, overrides
