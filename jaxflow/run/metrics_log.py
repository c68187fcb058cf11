"""Run logging: JSONL + TensorBoard (and, with log.wandb, wandb) metrics, a rich progress bar on a terminal (else
one line per step), eval image grids."""
from __future__ import annotations

import json
import logging
import os
import sys
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageDraw, ImageFont

if TYPE_CHECKING:
    from jaxflow.run.wandb_log import WandbLog


def _scalars(metrics: dict) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        a = np.asarray(v)
        if a.ndim == 0:
            out[k] = float(a)
        else:  # per window step vectors, e.g. logp_diff_mean
            out.update({f"{k}/{i}": float(x) for i, x in enumerate(a.reshape(-1))})
    return out


def _drop_rows_after(path: Path, step: int) -> None:
    """A resumed run continues from its checkpoint at `step`: rows logged after it (by a run killed before its next
    checkpoint, to be logged again) and a line cut by a kill are dropped, so each step has one row."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(keep))
    os.replace(tmp, path)


def step_line(flat: dict, total_steps: int) -> str:
    """One line per step for a log file: reward mean±std, phase times, throughput, eval reward when evaluated."""
    phases = " ".join(f"{p} {flat[f'time/{p}']:.1f}s" for p in ("rollout", "reward", "train", "sync")
                      if f"time/{p}" in flat)
    line = (f"{time.strftime('%H:%M:%S')} step {flat['step']}/{total_steps}  reward {flat['reward_mean']:.3f}"
            f"±{flat['reward_std']:.3f}  {phases}  {flat.get('images_per_s', 0):.2f} img/s")
    if flat.get("reward_errors"):
        line += f"  reward errors {flat['reward_errors']:.0f}"
    if flat.get("skipped"):
        line += "  update skipped (non-finite)"
    if flat.get("zero_advantage_step"):
        line += "  no update (every advantage 0)"
    if "eval_reward_mean" in flat:
        line += f"  eval reward {flat['eval_reward_mean']:.3f}"
    return line


def eval_grid_path(run_dir: Path, step: int) -> Path:
    """Where the eval after `step` writes its image grid."""
    return Path(run_dir) / "eval" / f"step_{step:06d}.png"


class RunLog:
    """metrics.jsonl (one row per step), TensorBoard scalars, a `wandb` log's rows and eval grids and, with
    `progress`, a rich progress bar on a terminal or one printed line per step when stdout is a file (nohup, SLURM).
    The RunLog closes the wandb log it is given."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, tensorboard: bool, progress: bool,
                 wandb: WandbLog | None = None):
        self.run_dir, self._wandb = run_dir, wandb
        run_dir.mkdir(parents=True, exist_ok=True)
        _drop_rows_after(run_dir / "metrics.jsonl", start_step)
        self._jsonl = open(run_dir / "metrics.jsonl", "a")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter
            # NaN/Inf scalars (a diverged run) are logged as they are; tensorboardX would warn once per value
            logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
            # a resume (also one that fell back to an older checkpoint) hides the event log's points from the
            # replayed steps on, as metrics.jsonl drops their rows
            self._tb = SummaryWriter(str(run_dir / "tb"), purge_step=start_step + 1 if start_step else None)
        self._progress, self.total_steps = None, total_steps
        self._lines = progress and not sys.stdout.isatty()  # a log file: one line per step, not a progress bar
        if progress and not self._lines:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
            self._progress = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                      TimeRemainingColumn(), TextColumn("{task.fields[status]}"))
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, status="")
            self._progress.start()

    def log(self, step: int, metrics: dict) -> dict[str, float]:
        """One row for `step` = the number of updates completed (1..num_steps)."""
        flat = {"step": step, "time": time.time(), **_scalars(metrics)}
        self._jsonl.write(json.dumps(flat) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in flat.items():
                if k not in ("step", "time"):
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            grid = eval_grid_path(self.run_dir, step)  # written by this step's eval, if it had one
            grid = grid if "eval_reward_mean" in flat and grid.exists() else None
            self._wandb.log(step, {k: v for k, v in flat.items() if k != "step"}, grid)
        if self._lines and "reward_mean" in flat:
            print(step_line(flat, self.total_steps), flush=True)
        if self._progress is not None and "reward_mean" in flat:
            phases = " ".join(f"{p}={flat[f'time/{p}']:.1f}s" for p in ("rollout", "reward", "train", "sync")
                              if f"time/{p}" in flat)
            self._progress.update(self._task, completed=step,
                                  status=f"reward {flat['reward_mean']:.3f} | {phases}")
        return flat

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close()
        self._jsonl.close()


def caption_lines(caption: str, chars: int, lines: int) -> list[str]:
    """`caption` wrapped at spaces into at most `lines` lines of `chars`; a longer one ends in ' ...'."""
    wrapped = textwrap.wrap(caption, chars)
    if len(wrapped) > lines:
        wrapped = wrapped[:lines - 1] + [textwrap.shorten(" ".join(wrapped[lines - 1:]), chars, placeholder=" ...")]
    return wrapped


def image_grid(images: np.ndarray, captions: list[str], path: Path, columns: int = 4) -> None:
    """PNG grid of uint8 (B, H, W, 3) images with a caption (prompt and reward) under each."""
    b, h, w, _ = images.shape
    font = ImageFont.load_default()
    lines = 3
    cell_w, cap_h = max(w, 160), 12 * lines + 4
    rows = -(-b // columns)
    grid = Image.new("RGB", (columns * cell_w, rows * (h + cap_h)), "white")
    draw = ImageDraw.Draw(grid)
    chars = max(8, cell_w // 6)
    for i, (img, cap) in enumerate(zip(images, captions)):
        x, y = (i % columns) * cell_w, (i // columns) * (h + cap_h)
        grid.paste(Image.fromarray(img), (x, y))
        draw.multiline_text((x + 2, y + h + 2), "\n".join(caption_lines(cap, chars, lines)), fill="black", font=font)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
