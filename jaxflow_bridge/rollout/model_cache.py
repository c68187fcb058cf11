"""The cache of built model folders every family's tiny model uses (``$JAXFLOW_CACHE`` or ``~/.cache/jaxflow``):
atomic first build, reuse after; the dtypes those folders are saved in, and a builder's command line."""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_dtype(dtype: str) -> None:
    """ValueError unless `dtype` is one of the cached folders' dtypes."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")


class CacheUnwritable(OSError):
    """The cache folder (``$JAXFLOW_CACHE`` or ``~/.cache/jaxflow``) cannot hold a new tiny folder; the message names
    the variable, the path and the cause."""


def cache_root() -> Path:
    """``$JAXFLOW_CACHE``, or ``~/.cache/jaxflow``."""
    return Path(os.environ.get("JAXFLOW_CACHE") or Path.home() / ".cache" / "jaxflow")


def cached_folder(name: str, marker: str, build: Callable[[Path], object]) -> Path:
    """``cache_root() / name``, built atomically on first use by ``build(temporary folder)`` and reused once it holds
    ``marker``; a process that loses the race to another one takes the other's folder."""
    root = cache_root()
    final = root / name
    if (final / marker).is_file():
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    except OSError as exc:
        raise CacheUnwritable(f"JAXFLOW_CACHE={root}: cannot build {name} there ({exc.strerror or exc}): set "
                              f"JAXFLOW_CACHE to a writable folder") from exc
    try:
        build(tmp)
        try:
            os.replace(tmp, final)
        except OSError:  # another process finished first
            if not (final / marker).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def folder_cli(doc: str, build: Callable[[str, int, str], Path], argv=None) -> None:
    """A tiny folder builder's command line: ``--out DIR [--seed 0] [--dtype float32]``; prints the folder."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = parser.parse_args(argv)
    print(build(args.out, args.seed, args.dtype))
