"""jaxflow_bench.e2e's result file as the run goes (jaxflow_bench/run_result.py), fed metrics lines by hand: a
partial result after each step that leaves figures, the final write over it, and writes that are whole or not at
all; --scaling runs a layout again whose result is only partial."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest

from jaxflow_bench import e2e_series
from jaxflow_bench.results import finished, write_result
from jaxflow_bench.run_result import RunResult
from jaxflow_bench.summary import steady_figures


def row(step: int, images_per_s: float) -> dict:
    return {"step": step, "time": time.time(), "time/step": 10.0, "time/rollout": 6.0, "time/reward": 1.0,
            "time/train": 3.0, "time/sync": 0.5, "images_per_s": images_per_s}


def log(run: Path, *rows: dict, tail: str = "") -> None:
    """Append rows to run/metrics.jsonl as the trainer does, then `tail` (a line still being written)."""
    run.mkdir(parents=True, exist_ok=True)
    with open(run / "metrics.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows) + tail)


def result(tmp_path: Path) -> RunResult:
    return RunResult(tmp_path / "run", tmp_path, "e2e_cpu_1gpu", "python -m jaxflow_bench.e2e OUT",
                     lambda rows: steady_figures(rows, gpus=2))


def read(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "e2e_cpu_1gpu.json").read_text())


def test_a_partial_result_follows_each_step_that_leaves_figures(tmp_path):
    """Step 1 (compile) alone leaves no figures, so no file; after step k the file is partial with steps_done k and
    the medians of steps 2..k; a half-written line is not read."""
    r = result(tmp_path)
    assert r.update() is None  # no metrics.jsonl yet
    log(tmp_path / "run", row(1, 0.5))
    assert r.update() is None and not (tmp_path / "e2e_cpu_1gpu.json").exists()
    log(tmp_path / "run", row(2, 4.0), tail='{"step": 3, "time/st')
    path = r.update()
    got = read(tmp_path)
    assert path == tmp_path / "e2e_cpu_1gpu.json" and got["partial"] is True
    assert got["figures"]["steps_done"] == 2 and got["figures"]["steps_timed"] == 1
    assert got["figures"]["img_per_gpu_s"] == 2.0 and got["name"] == "e2e_cpu_1gpu"
    assert {"name", "command", "device", "date", "figures"} <= set(got)
    assert r.update() is None  # nothing new since
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in (
        row(1, 0.5), row(2, 4.0), row(3, 6.0), row(4, 8.0))))
    r.update()
    got = read(tmp_path)
    assert got["figures"]["steps_done"] == 4 and got["figures"]["img_per_gpu_s"] == 3.0 and not finished(
        tmp_path / "e2e_cpu_1gpu.json")


def test_rows_an_earlier_run_left_are_not_summarized(tmp_path):
    """A metrics.jsonl from before this result began (the trainer clears it as it starts) makes no partial file."""
    log(tmp_path / "run", dict(row(1, 1.0), time=0.0), dict(row(2, 1.0), time=1.0))
    assert result(tmp_path).update() is None and not (tmp_path / "e2e_cpu_1gpu.json").exists()


def test_the_final_write_clears_partial(tmp_path):
    r = result(tmp_path)
    log(tmp_path / "run", row(1, 0.5), row(2, 4.0))
    r.update()
    assert read(tmp_path)["partial"] is True
    log(tmp_path / "run", row(3, 8.0))
    r.final()
    got = read(tmp_path)
    assert "partial" not in got and "steps_done" not in got["figures"] and finished(tmp_path / "e2e_cpu_1gpu.json")
    assert got["figures"]["steps_timed"] == 2 and got["figures"]["img_per_gpu_s"] == 3.0


def test_the_final_write_without_a_step_to_time_is_an_error(tmp_path):
    log(tmp_path / "run", row(1, 0.5))
    with pytest.raises(RuntimeError, match="no step after the first"):
        result(tmp_path).final()


def cut_writes(monkeypatch):
    """Every Path.write_text writes half its text and fails (a disk that fills, a process cut mid-write)."""
    def half(self, text, *a, **k):
        with open(self, "w") as f:
            f.write(text[:len(text) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half)


def test_a_write_cut_short_leaves_the_earlier_result(tmp_path, monkeypatch):
    path = write_result(tmp_path, "r", {"img_per_gpu_s": 1.0}, command="first")
    cut_writes(monkeypatch)
    with pytest.raises(OSError):
        write_result(tmp_path, "r", {"img_per_gpu_s": 2.0}, command="second")
    assert json.loads(path.read_text())["command"] == "first" and list(tmp_path.iterdir()) == [path]


def test_a_failing_partial_write_while_watching_keeps_the_earlier_file(tmp_path, monkeypatch, capsys):
    """The watcher looks once more as its block ends: a failed write is reported, the step-2 result stays whole."""
    r = result(tmp_path)
    with r.watching(every=3600):
        log(tmp_path / "run", row(1, 0.5), row(2, 4.0))
    assert read(tmp_path)["figures"]["steps_done"] == 2
    cut_writes(monkeypatch)
    with r.watching(every=3600):
        log(tmp_path / "run", row(3, 8.0))
    monkeypatch.undo()
    assert read(tmp_path)["figures"]["steps_done"] == 2 and read(tmp_path)["partial"] is True
    assert "warning: the partial result e2e_cpu_1gpu.json was not written" in capsys.readouterr().err


def test_scaling_runs_again_a_layout_whose_result_is_partial(tmp_path):
    """A lease that ended mid-run left a partial e2e_1gpu.json: --scaling runs 1gpu again and keeps whole results."""
    whole = {"img_per_gpu_s": 0.9, "step_s": 30.0, "gpus": 2}
    write_result(tmp_path / "1gpu", "e2e_1gpu", {"img_per_gpu_s": 0.1, "step_s": 30.0, "gpus": 1, "steps_done": 2},
                 command="cut", extra={"partial": True})
    write_result(tmp_path / "2gpu_colocated", "e2e_2gpu_colocated", whole, command="whole")
    ran = []

    def fake_run(args, overrides, env=None):
        ran.append(args.layout)
        write_result(args.out, args.result, {"img_per_gpu_s": 1.0, "step_s": 30.0, "gpus": 1}, command="again")

    args = argparse.Namespace(out=tmp_path, layouts=["2gpu_colocated"], micro=None, colocated_pool=0.5,
                              colocated_micro=2)
    e2e_series.scaling(args, [], fake_run)
    assert ran == ["1gpu"]
    figures = json.loads((tmp_path / "e2e_2gpu.json").read_text())["figures"]
    assert figures["one_gpu_img_per_gpu_s"] == 1.0 and figures["scaling_vs_1gpu"] == pytest.approx(1.8)
