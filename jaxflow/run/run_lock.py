"""One run at a time in a run_dir: the command line's preflight takes an exclusive lock on `run_dir/.jaxflow.lock`
(process 0 of a multi-process run) before anything is written, and holds it until the process exits.

The lock is flock(2) on the open file, held by the kernel, not by the file's existence: it ends with the process
however it ends, kill -9 included (on NFSv4 the server drops a crashed client's locks once its lease lapses, about
90 s). The file keeps its holder's host, pid and start time, for the line that refuses a second run, and is emptied
when the holder releases it at exit. A file that still names a holder while no process holds the lock was left by a
run that was killed: its holder is provably gone (the kernel or the NFS server released the lock), so the lock is
taken over, with a warning naming that run. A run that made the run_dir and wrote nothing else into it (refused
before any work) removes the file and the folder at exit: a lock is held only on the file that stands at its path
(checked after locking), so a run that locked a file just removed takes the new one instead.

Filesystems: local ones and NFS (v4, or v3 with its lock daemon) lock across hosts. Lustre does only when mounted
with `-o flock` (with `-o localflock` a lock is seen on its own node only); where the filesystem refuses locks, the
run goes on unlocked with a warning.
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from jaxflow.config.errors import UserError

log = logging.getLogger("jaxflow.run.run_dir")

LOCK_NAME = ".jaxflow.lock"
_held: dict[str, int] = {}  # run_dir (resolved) -> the descriptor of its lock file, held by this process


def _holder(text: str) -> str:
    """The holder a lock file names, in words."""
    try:
        who = json.loads(text)
        where = "this host" if who["host"] == socket.gethostname() else f"host {who['host']}"
        return f"pid {who['pid']} on {where}, since {who['since']}"
    except (ValueError, KeyError, TypeError):
        return "a holder that has not written its name yet"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def acquire(run_dir: Path) -> None:
    """Lock `run_dir` (made if missing) for this process until it exits; again for a run_dir it holds: nothing.
    UserError naming the holder (host, pid) and the ways out when another process holds it."""
    key = str(run_dir.resolve())
    if key in _held:
        return
    made = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):  # no locks on this filesystem (e.g. Lustre)
                log.warning("%s: this filesystem refuses locks (%s); the run goes on unlocked: nothing stops a second "
                            "run started into this run_dir (mount Lustre with -o flock)", path, exc.strerror)
                return
            raise UserError(f"run_dir {run_dir} is in use by another run ({_in_use(path)}): wait for it to end or "
                            f"stop it, or pass --config.run_dir=NEW_DIR") from None
        if _stands_at(fd, path):
            break
        os.close(fd)  # locked a file its holder removed at exit: lock the one at the path now
    left = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    if left:
        log.warning("%s: taking over the lock of a run that ended without releasing it (killed?): %s", path,
                    _holder(left))
    record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                         "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)
    os.fsync(fd)
    _held[key] = fd
    atexit.register(_release, key, made)


def _in_use(path: Path) -> str:
    """The holder in words; a pid on this host that has exited points at a process it started, which holds the
    lock it inherited."""
    text = path.read_text(errors="replace").strip()
    words = _holder(text)
    try:
        who = json.loads(text)
        if who["host"] == socket.gethostname() and not _alive(int(who["pid"])):
            words += f"; that pid has exited, a process it started holds the lock: find it with fuser {path}"
    except (ValueError, KeyError, TypeError):
        pass
    return words


def release(run_dir: Path) -> None:
    """Empty the lock file and release the lock, if this process holds it (done at exit)."""
    _release(str(run_dir.resolve()))


def _stands_at(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _release(key: str, made: bool = False) -> None:
    """Empty the file and unlock it; remove it and the run_dir when this run `made` the folder and left nothing else
    in it."""
    fd = _held.pop(key, None)
    if fd is None:
        return
    os.ftruncate(fd, 0)
    run_dir = Path(key)
    if made and [p.name for p in run_dir.iterdir()] == [LOCK_NAME]:
        (run_dir / LOCK_NAME).unlink()
        run_dir.rmdir()
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
