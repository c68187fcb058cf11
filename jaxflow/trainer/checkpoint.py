"""Orbax checkpoints of the train state + run metadata, and the final PEFT export."""
from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import shutil
import sys
import zlib
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxflow.config.errors import UserError

log = logging.getLogger(__name__)


def _flat(tree) -> tuple[dict[str, jax.Array], list[str]]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {f"{i:05d}": v for i, (_, v) in enumerate(leaves)}, [jax.tree_util.keystr(p) for p, _ in leaves]


class Checkpointer:
    """Saves {state leaves, metadata json} under `directory/<step>`; keeps the last `keep`.

    Saves are synchronous and orbax writes each one into a temporary folder renamed on completion, so a process
    killed mid-save leaves the previous checkpoints readable. Each leaf's crc32 is saved with it and checked on
    restore: a file changed after the save counts as damaged, like one that no longer decompresses. The temporary
    folder of a save cut short (`<step>.orbax-checkpoint-tmp`) is removed when the next Checkpointer opens.
    """

    def __init__(self, directory: str | Path, keep: int):
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False,
                                               cleanup_tmp_directories=True)
        self.directory = Path(directory).resolve()
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, meta: dict) -> None:
        arrays, paths = _flat(state)
        sums = {k: checksum(v) for k, v in arrays.items()}
        args = ocp.args.Composite(state=ocp.args.StandardSave(arrays),
                                  meta=ocp.args.JsonSave({**meta, "state_paths": paths, "checksums": sums}))
        try:
            with _quiet_disk_full():
                self.manager.save(step, args=args, force=True)
                self.manager.wait_until_finished()
        except Exception as exc:
            if no_space(exc) is None:
                raise
            _quiet_abandoned_reads()  # the writes orbax abandons report into its closed event loop, as reads do
            if jax.process_index() == 0:  # the unfinished save's folder, never renamed to its step: space back
                for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                    shutil.rmtree(partial, ignore_errors=True)
            raise OSError(errno.ENOSPC, f"no space left on device for checkpoint {step}", str(self.directory)) \
                from exc

    def restore(self, abstract_state, step: int | None = None):
        """(state, meta) of `step`, by default of the newest checkpoint that restores: a newer one that does not (a
        damaged or missing file) is moved aside to `<step>.damaged`, with a warning naming it and the cause. The
        state comes back with `abstract_state`'s shardings."""
        _quiet_abandoned_reads()
        if step is not None:
            return self._restore(abstract_state, step)
        skipped = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                return self._restore(abstract_state, step)
            except UserError:
                raise
            except Exception as exc:  # noqa: BLE001 - any read failure of a checkpoint's files
                skipped.append(f"{step}: {_cause(exc)}")
                self._set_aside(step)
                log.warning("checkpoint %d does not restore (%s): moved to %s.damaged, trying the one before",
                            step, _cause(exc), self.directory / str(step))
        raise UserError(f"no checkpoint in {self.directory} restores" +
                        (f" ({'; '.join(skipped)})" if skipped else "") +
                        ": start the run again with --overwrite (deletes its outputs), or use a new run_dir")

    def _set_aside(self, step: int) -> None:
        """Rename a damaged checkpoint out of orbax's sight (kept for inspection; its step can be saved again)."""
        if jax.process_index() == 0:
            (self.directory / str(step)).rename(self.directory / f"{step}.damaged")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(f"checkpoint {step} set aside")
        self.manager.reload()

    def _restore(self, abstract_state, step: int):
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        target, paths = _flat(abstract_state)
        if meta["state_paths"] != paths:
            raise UserError(f"checkpoint {self.directory}/{step} was written for a different train state "
                            f"(LoRA targets/rank, EMA, optimizer or train.algorithm changed): "
                            f"{len(meta['state_paths'])} leaves saved, {len(paths)} expected")
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=getattr(v, "sharding", None))
                    for k, v in target.items()}
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
        for k, saved in meta.get("checksums", {}).items():  # bytes that read back but are not what was written
            got = checksum(restored["state"][k])
            if saved is not None and got is not None and got != saved:
                raise ValueError(f"leaf {meta['state_paths'][int(k)]} reads back with another checksum "
                                 f"(crc32 {got:08x}, saved {saved:08x}): the file was changed after the save")
        leaves = [restored["state"][k] for k in sorted(restored["state"])]
        return jax.tree.unflatten(jax.tree.structure(abstract_state), leaves), meta


NO_SPACE_TEXT = ("No space left on device", "Disk quota exceeded")


def no_space(exc: BaseException | None) -> BaseException | None:
    """The error of `exc`'s chain that says its filesystem is full (ENOSPC, EDQUOT, or TensorStore's text): the
    innermost one naming its file, else the innermost; None when there is none."""
    found = []
    while exc is not None and exc not in found:
        found.append(exc)
        exc = exc.__cause__ or exc.__context__
    full = [e for e in found if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
            or any(t in str(e) for t in NO_SPACE_TEXT)]
    named = [e for e in full if getattr(e, "filename", None)]
    return (named or full or [None])[-1]


class _DropDiskFull(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(t in record.getMessage() for t in NO_SPACE_TEXT)


@contextlib.contextmanager
def _quiet_disk_full():
    """Orbax's worker threads log a traceback each for a full disk; the save raises it once, so drop those logs."""
    logger, drop = logging.getLogger("absl"), _DropDiskFull()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


class _AbandonedTasks(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(("Task exception was never retrieved",
                                                   "Future exception was never retrieved",
                                                   "Task was destroyed but it is pending"))


@functools.cache
def _quiet_abandoned_reads() -> None:
    """A restore stops at its first unreadable file (a save at its first write to a full disk): orbax then closes
    its event loop over the reads (writes) of the other files still in flight, whose completions TensorStore reports
    as "Event loop is closed" and asyncio as "Task (or Future) exception was never retrieved", hundreds of traceback
    lines after the one line naming the checkpoint. Drops those reports from then on, in this process (other
    unraisable exceptions and asyncio errors still print)."""
    previous = sys.unraisablehook

    def hook(unraisable):
        if not (unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed"):
            previous(unraisable)

    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_AbandonedTasks())


def checksum(x) -> int | None:
    """crc32 of an array's bytes (None for an array this process does not hold whole)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return None
    return zlib.crc32(np.ascontiguousarray(np.asarray(x)).view(np.uint8))


def _cause(exc: BaseException) -> str:
    """The first line of the innermost cause (TensorStore's reason, e.g. 'ZSTD_decompressStream() failed')."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return line if len(line) <= 240 else line[:237] + "..."


def config_json(cfg) -> str:
    """The config as JSON (tuples become lists), stored with every checkpoint."""
    return json.dumps(cfg.to_dict(), default=lambda o: list(o) if isinstance(o, tuple) else str(o), sort_keys=True)


def assert_finite(tree) -> None:
    bad = [jax.tree_util.keystr(p) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]
           if not np.all(np.isfinite(np.asarray(v)))]
    if bad:
        raise ValueError(f"non-finite values in {bad[:5]}")
