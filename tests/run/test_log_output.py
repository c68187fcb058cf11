"""A run whose stdout is a file (nohup, SLURM): a line as each start-up phase begins, one line per step, no library
INFO or start-up warnings (Ray's token notice, JAX's fork warning), and a closing summary of where every output went; --verbose brings INFO back."""
import re
import subprocess
import sys
from pathlib import Path
import pytest

from jaxflow.run.metrics_log import RunLog
from tests.helpers import ROOT
from tests import HANG_S


def test_one_printed_line_per_step_when_stdout_is_not_a_terminal(tmp_path, capsys):
    runlog = RunLog(tmp_path, 3, 0, tensorboard=False, progress=True)  # pytest's captured stdout is no terminal
    for step in (1, 2):
        runlog.log(step, {"reward_mean": 0.5, "reward_std": 0.25, "time/rollout": 1.0, "time/train": 2.0,
                          "images_per_s": 4.0, **({"eval_reward_mean": 0.75} if step == 2 else {})})
    runlog.close()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "step 1/3  reward 0.500±0.250  rollout 1.0s train 2.0s  4.00 img/s" in lines[0]
    assert lines[1].endswith("eval reward 0.750")


def test_non_finite_scalars_are_logged_without_warnings(tmp_path, caplog):
    """A diverged run's NaN/Inf metrics: kept in metrics.jsonl and TensorBoard, with no warning per value (33 lines
    of tensorboardX's "NaN or Inf found in input tensor" for one run at lr 1e30)."""
    import json
    import math

    runlog = RunLog(tmp_path, 3, 0, tensorboard=True, progress=False)
    for step in (1, 2):
        runlog.log(step, {"loss": float("nan"), "grad_norm": float("inf"), "reward_mean": 0.5})
    runlog.close()
    assert "NaN or Inf" not in caplog.text and not [r for r in caplog.records if r.levelno >= 30]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [math.isnan(r["loss"]) and math.isinf(r["grad_norm"]) for r in rows] == [True, True]
    assert [math.isnan(v) for v in _tb_scalars(tmp_path / "tb", "loss")] == [True, True]


def _tb_scalars(tb_dir: Path, tag: str) -> list[float]:
    """`tag`'s values in a TensorBoard event log (records: 8-byte length, 4-byte crc, an Event, 4-byte crc)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event
    values = []
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        raw, at = path.read_bytes(), 0
        while at < len(raw):
            (size,) = struct.unpack("<Q", raw[at:at + 8])
            event = Event.FromString(raw[at + 12:at + 12 + size])
            values += [v.simple_value for v in event.summary.value if v.tag == tag]
            at += 12 + size + 4
    return values


@pytest.mark.slow
def test_run_logged_to_a_file_is_a_line_per_step_and_a_summary(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "jaxflow.train", "--config", str(ROOT / "configs" / "tiny_ocr.py"),
         f"--config.run_dir={run_dir}", "--config.train.num_steps=2", "--config.checkpoint.every=1",
         "--config.eval.every=1000", "--config.log.tensorboard=False", "--config.rollout.num_cpus=0",
         "--config.reward.fns={'jpeg_incompressibility': 1.0}"],
        cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.strip() == ""  # no orbax/absl INFO, no Ray token notice, no os.fork() warning
    sync = [line for line in out.stdout.splitlines() if line.startswith("LoRA sync: transport=")]
    assert len(sync) == 1, out.stdout  # the LoRA sync's transport, chosen once at start, said once
    lines = [line for line in out.stdout.splitlines() if line not in sync]
    (at,) = [i for i, line in enumerate(lines) if line.startswith("plan: ")]  # the run's plan, said once, after
    assert lines[at - 1].startswith("training ")  # the training line: its block of indented lines taken out here
    end = next(i for i in range(at + 1, len(lines)) if not lines[i].startswith("  "))
    assert end - at >= 3, lines[at:end]  # the plan's devices, the trainer's linears, the rollout
    lines = lines[:at] + lines[end:]
    names = ["checks", "prompts and rewards", "trainer's model", "memory plan", "train state",
             "waiting for the rollout engines", "first LoRA sync"]
    assert lines[:8] == [f"start-up: {name} ..." for name in ["Ray", *names]]  # each phase as it begins
    lines = lines[8:]
    assert lines[0].startswith(f"training {run_dir}") and " step 1/2  reward " in lines[2] and " step 2/2 " in lines[3]
    total, phases = re.fullmatch(r"start-up (\d+) s: (.*)", lines[1]).groups()  # where the start went, in order
    detail = re.search(r"memory plan \d+ s \((.*?)\)", phases)  # its compiles by stage, then taken out here
    assert detail and re.fullmatch(r"trace \d+ s, lower \d+ s, compile \d+ s(, load \d+ s)?; \d+ of \d+ compiles "
                                   r"from the cache, \d+ of \d+ from the executable cache, XLA's autotune cache "
                                   r"held \d+ results", detail.group(1)), lines[1]
    phases = phases.replace(f" ({detail.group(1)})", "")
    sync = re.search(r"first LoRA sync \d+ s \((.*?)\)", phases)  # the first sync's parts, taken out too
    assert sync and re.fullmatch(r"write \d+ s(, engines \d+ s)?(, check \d+ s)?", sync.group(1)), lines[1]
    phases = phases.replace(f" ({sync.group(1)})", "")
    phases, _, overlap = phases.partition("; ")  # the engines' start beside the trainer's, where it overlapped
    assert not overlap or re.fullmatch(r"the rollout engines started in \d+ s, \d+ s of it beside the trainer's "
                                       r"model, the memory plan and the train state", overlap), lines[1]
    # Ray's start (the command line's, before the trainer's phases) is the first part and counts in the total
    assert [re.fullmatch(r"(.+) (\d+) s", part).group(1) for part in phases.split(", ")] == ["Ray", *names], lines[1]
    assert abs(sum(int(part.rsplit(" ", 2)[1]) for part in phases.split(", ")) - int(total)) <= len(names) + 1
    summary = "\n".join(lines[4:])
    assert lines[4].startswith("finished at step 2/2")
    for needle in ("metrics.jsonl", "checkpoints (steps 1, 2", "lora_final", "Ray logs"):
        assert needle in summary, summary
    ray_logs = next(line for line in lines if "Ray logs" in line).split()[2]
    assert Path(ray_logs).name == "logs" and Path(ray_logs).is_dir(), ray_logs  # the run's own Ray session


def test_verbose_brings_library_info_back(tmp_path):
    code = ("import sys, jax.numpy as jnp; from jaxflow.run.cli import configure_logging; "
            "from jaxflow.trainer.checkpoint import Checkpointer; configure_logging(sys.argv[1] == 'verbose'); "
            f"Checkpointer({str(tmp_path)!r} + '/' + sys.argv[1], 1).save(1, {{'a': jnp.ones(3)}}, {{}})")
    quiet, verbose = (subprocess.run([sys.executable, "-c", code, mode], cwd=ROOT, capture_output=True, text=True,
                                     timeout=HANG_S) for mode in ("quiet", "verbose"))
    assert quiet.returncode == verbose.returncode == 0, quiet.stderr[-2000:] + verbose.stderr[-2000:]
    assert quiet.stderr == "" and "Saving checkpoint at step 1" in verbose.stderr
