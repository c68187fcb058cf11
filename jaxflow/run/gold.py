"""Gold rewards against over-optimization: which eval is the best so far by a gold metric (`eval.best_metric`, its
adapter kept in run_dir/lora_best), and when to stop early (`eval.stop_after`): the gold metric fell at N
consecutive evals while the training reward rose at each of them (the policy hacks the training reward).

`GoldWatch` is the bookkeeping alone (process 0's); `publish` swaps a finished export into place, so that
lora_best/ is always a whole adapter: the previous one or the new one, never a half-written folder."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

BEST_FILE = "best.json"  # in lora_best/: {"step", "metric", "value"} of the eval it holds


def gold_key(name: str) -> str:
    """The metrics.jsonl / TensorBoard name of gold reward `name`'s eval mean."""
    return f"eval_gold/{name}"


TRAIN_KEY = "eval_reward_mean"  # the training reward (its weighted sum) on the eval prompts


@dataclasses.dataclass
class Verdict:
    best: bool  # this eval is the best so far by the gold metric: keep its adapter
    stop: str | None  # why the run stops early (one line), or None


@dataclasses.dataclass
class GoldWatch:
    """Fed each eval's (step, gold value, training reward) in order by `record`. `stop_after` 0: never stops.
    `best_step`/`best_value`: the best eval so far (from lora_best/best.json on a resumed run; the streak of falls
    starts anew there)."""

    metric: str
    stop_after: int = 0
    best_step: int | None = None
    best_value: float | None = None
    streak: int = 0
    previous: tuple[float, float] | None = None  # the last eval's (gold, training reward)

    def record(self, step: int, gold: float, train: float) -> Verdict:
        best = self.best_value is None or gold > self.best_value
        if best:
            self.best_step, self.best_value = step, gold
        if self.previous is not None and gold < self.previous[0] and train > self.previous[1]:
            self.streak += 1
        else:
            self.streak = 0
        self.previous = (gold, train)
        stop = None
        if self.stop_after and self.streak >= self.stop_after:
            stop = (f"{gold_key(self.metric)} fell at {self.streak} evals in a row while {TRAIN_KEY} rose "
                    f"(over-optimization; eval.stop_after={self.stop_after}): stopped after step {step}; lora_best "
                    f"holds step {self.best_step} ({gold_key(self.metric)} {self.best_value:.4f})")
        return Verdict(best, stop)

    @classmethod
    def resume(cls, metric: str, stop_after: int, folder: Path) -> "GoldWatch":
        """A watch that knows the best eval `folder` (run_dir/lora_best) holds, if it holds one of `metric`."""
        watch = cls(metric, stop_after)
        path = folder / BEST_FILE
        if path.is_file():
            saved = json.loads(path.read_text())
            if saved.get("metric") == metric:
                watch.best_step, watch.best_value = saved["step"], saved["value"]
        return watch

    def note(self) -> dict:
        """What lora_best/best.json records of the best eval."""
        return {"step": self.best_step, "metric": self.metric, "value": self.best_value}


def staging(dest: Path) -> Path:
    """The folder an export to `dest` is written into before `publish` (left over by a crash: removed first)."""
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def publish(tmp: Path, dest: Path, note: dict) -> None:
    """Make the finished export `tmp` the folder `dest` (with `note` as its best.json): renames only, so `dest` is
    at every moment absent, the previous whole folder or the new one (a crash between the two renames leaves the
    previous one whole as `dest.old`)."""
    (tmp / BEST_FILE).write_text(json.dumps(note))
    old = dest.with_name(dest.name + ".old")
    if dest.exists():
        shutil.rmtree(old, ignore_errors=True)
        dest.rename(old)
    tmp.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
