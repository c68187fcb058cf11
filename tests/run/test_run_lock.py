"""One run at a time in a run_dir: a second holder is refused naming the first (host, pid) and the way out, also by
the command line (exit 2, one line) and by --overwrite; a lock left by a killed run is taken over with a warning."""
import json
import os
import signal
import subprocess
import sys

import pytest

from jaxflow.run import run_dir as run_dir_lib
from jaxflow.run import run_lock
from jaxflow.config.errors import UserError
from tests.helpers import ROOT, fake_run, tiny_config
from tests import HANG_S

HOLD = ("import sys; from pathlib import Path; from jaxflow.run import run_lock; run_lock.acquire(Path(sys.argv[1])); "
        "print('held', flush=True); sys.stdin.read()")


def holder(run_dir):
    """A process that holds `run_dir`'s lock until its stdin closes."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_holder_is_refused_naming_the_first_until_it_exits(tmp_path, caplog):
    proc = holder(tmp_path)
    try:
        with pytest.raises(UserError, match=rf"run_dir {tmp_path} is in use by another run \(pid {proc.pid} on this "
                                            rf"host, since .*\): wait for it to end or stop it, or pass "
                                            rf"--config.run_dir=NEW_DIR"):
            run_lock.acquire(tmp_path)
    finally:
        proc.communicate("", timeout=HANG_S)
    assert proc.returncode == 0 and (tmp_path / run_lock.LOCK_NAME).read_text() == ""  # released at exit, emptied
    run_lock.acquire(tmp_path)
    try:
        assert json.loads((tmp_path / run_lock.LOCK_NAME).read_text())["pid"] == os.getpid()
        assert "taking over" not in caplog.text
        run_lock.acquire(tmp_path)  # this process holds it already
    finally:
        run_lock.release(tmp_path)


def test_the_lock_of_a_killed_run_is_taken_over_with_a_warning(tmp_path, caplog):
    proc = holder(tmp_path)
    proc.send_signal(signal.SIGKILL)  # no release: the file still names it, the kernel dropped its lock
    proc.wait(timeout=HANG_S)
    assert json.loads((tmp_path / run_lock.LOCK_NAME).read_text())["pid"] == proc.pid
    run_lock.acquire(tmp_path)
    try:
        assert f"taking over the lock of a run that ended without releasing it (killed?): pid {proc.pid}" in caplog.text
        assert json.loads((tmp_path / run_lock.LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        run_lock.release(tmp_path)


def test_a_stale_lock_file_naming_a_dead_pid_is_taken_over(tmp_path, caplog):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          timeout=HANG_S)
    pid = int(dead.stdout)
    (tmp_path / run_lock.LOCK_NAME).write_text(json.dumps({"host": "elsewhere", "pid": pid, "since": "then"}))
    run_lock.acquire(tmp_path)
    try:
        assert f"(killed?): pid {pid} on host elsewhere, since then" in caplog.text
    finally:
        run_lock.release(tmp_path)


def test_overwrite_never_deletes_a_run_dir_another_run_holds(tmp_path):
    cfg = tiny_config(tmp_path)
    fake_run(tmp_path, cfg)
    before = sorted(run_dir_lib.previous_outputs(tmp_path))
    proc = holder(tmp_path)
    try:
        with pytest.raises(UserError, match=f"in use by another run \\(pid {proc.pid} "):
            run_dir_lib.preflight(cfg, resume=False, overwrite=True)
        assert sorted(run_dir_lib.previous_outputs(tmp_path)) == before and before
    finally:
        proc.communicate("", timeout=HANG_S)


@pytest.mark.slow
def test_the_command_line_refuses_a_second_run_with_one_line_and_exit_2(tmp_path):
    proc = holder(tmp_path)
    try:
        out = subprocess.run([sys.executable, "-m", "jaxflow.train", f"--config.run_dir={tmp_path}",
                              "--config.reward.fns={'jpeg_incompressibility': 1.0}"], cwd=ROOT, capture_output=True,
                             text=True, timeout=HANG_S)
    finally:
        proc.communicate("", timeout=HANG_S)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: run_dir "), out.stderr[-2000:]
    assert f"pid {proc.pid} on this host" in lines[0] and "--config.run_dir=NEW_DIR" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [run_lock.LOCK_NAME]  # nothing else written


def test_a_run_dir_the_lock_made_and_nothing_else_filled_is_removed_at_exit(tmp_path):
    """A run refused before any work leaves no run_dir behind; a run_dir that held files before keeps its lock file."""
    fresh = tmp_path / "fresh" / "run"
    holder(fresh).communicate("", timeout=HANG_S)
    assert not fresh.exists() and (tmp_path / "fresh").is_dir()
    used = tmp_path / "used"
    used.mkdir()
    holder(used).communicate("", timeout=HANG_S)
    assert [p.name for p in used.iterdir()] == [run_lock.LOCK_NAME]
