"""wandb as an optional log beside metrics.jsonl and TensorBoard (log.wandb=True): the run's config, every metrics
row at its step and the eval grids as images. wandb is imported only here, only when the log is opened.

The wandb run's id is kept in run_dir/wandb_id: a resumed run (one starting from a checkpoint) continues the same
wandb run (resume="allow"); a run starting at step 0 opens a new one. Steps a resumed run replays (those logged
after its checkpoint by the run that was killed) are already in the wandb run, which keeps their first rows."""
from __future__ import annotations

import os
import secrets
from pathlib import Path

import numpy as np
from PIL import Image

from jaxflow.config.errors import fail

ID_FILE = "wandb_id"
MODES = ("offline", "online")


def run_id(run_dir: Path, start_step: int) -> str:
    """The wandb run id of run_dir: the kept one when resuming from a checkpoint, else a new one (then kept)."""
    path = run_dir / ID_FILE
    if start_step and path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    new = secrets.token_hex(4)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(new + "\n")
    os.replace(tmp, path)
    return new


class WandbLog:
    """One wandb run of a training run: `log(step, scalars, grid)` sends a metrics row (and an eval grid's PNG);
    `close()` finishes the run. The mode is log.wandb_mode unless the WANDB_MODE environment variable is set."""

    def __init__(self, run_dir: Path, start_step: int, project: str, mode: str, config: dict):
        try:
            import wandb
        except ImportError:
            fail("log.wandb", "True needs the wandb package: pip install wandb (or pass --config.log.wandb=False)")
        self._wandb = wandb
        run_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=project, dir=str(run_dir), mode=os.environ.get("WANDB_MODE") or mode,
                               id=run_id(run_dir, start_step), resume="allow", config=config)

    def log(self, step: int, scalars: dict[str, float], grid: Path | None = None) -> None:
        row = dict(scalars)
        if grid is not None:
            with Image.open(grid) as image:
                row["eval/grid"] = self._wandb.Image(np.asarray(image.convert("RGB")), caption=f"step {step}")
        self._run.log(row, step=step)

    def close(self) -> None:
        self._run.finish()
