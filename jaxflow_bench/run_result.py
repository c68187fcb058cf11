"""An e2e run's result file written as the run goes, so that a run cut short (a GPU lease that ends) leaves one.

A thread of the benchmark's process watches the trainer's metrics.jsonl: after each step that leaves figures (the
steady steps `summary.steady_figures` counts) OUT/NAME.json holds them with `"partial": true` and `steps_done` (the
last step logged); the final write at the run's end replaces it, unmarked. Each write is whole or not at all
(`results.write_result`).
"""
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from jaxflow_bench.results import write_result
from jaxflow_bench.summary import metrics_rows


class RunResult:
    """OUT/NAME.json of the run in `run_dir`: `figures` maps its metrics rows to the result's figures (None while
    no step counts)."""

    def __init__(self, run_dir: Path, out: Path, name: str, command: str,
                 figures: Callable[[list[dict]], dict | None]):
        self.run_dir, self.out, self.name, self.command, self.figures = Path(run_dir), Path(out), name, command, figures
        self._since, self._size = time.time(), None

    def update(self) -> Path | None:
        """Write the partial result where metrics.jsonl changed since the last look and has figures; its path, else
        None. Rows logged before this result began (a metrics.jsonl an earlier run left, not yet cleared by the
        trainer) are not summarized."""
        metrics = self.run_dir / "metrics.jsonl"
        size = metrics.stat().st_size if metrics.is_file() else None
        if size is None or size == self._size:
            return None
        self._size = size
        rows = metrics_rows(self.run_dir)
        if not rows or rows[0]["time"] < self._since:
            return None
        figures = self.figures(rows)
        if figures is None:
            return None
        return write_result(self.out, self.name, {**figures, "steps_done": rows[-1]["step"]}, command=self.command,
                            extra={"partial": True})

    def final(self) -> Path:
        """The result of the whole run, over any partial one (RuntimeError: no step to time)."""
        figures = self.figures(metrics_rows(self.run_dir))
        if figures is None:
            raise RuntimeError(f"{self.run_dir} has no step after the first to time: run more --steps")
        return write_result(self.out, self.name, figures, command=self.command)

    @contextmanager
    def watching(self, every: float = 2.0) -> Iterator[RunResult]:
        """`update` every `every` seconds in a thread while the block runs, and once more as it ends (a failed write
        is reported and the earlier file kept)."""
        stop = threading.Event()

        def look():
            try:
                self.update()
            except (OSError, ValueError, KeyError) as e:
                print(f"warning: the partial result {self.name}.json was not written: {e}", file=sys.stderr)

        def poll():
            while not stop.wait(every):
                look()

        thread = threading.Thread(target=poll, name="run-result", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()
            look()
