"""SIGINT and SIGTERM during start-up: the run stops at once with exit 130 and one line, however far it got.

From the command line's start until the training loop installs its own handlers (`Trainer.run`: finish the step,
checkpoint, exit 75), either signal raises `Interrupted` in the main thread; the command line prints its line,
releases what it started and ends the process with `exit_now`. That exit is `os._exit`: a normal interpreter exit
while XLA's and Ray's C++ threads are still at work can crash (a segfault, or an abort with a C++ stack dump).

An `Interrupted` raised in a finalizer or a gc callback (JAX has one) would be printed as "Exception ignored" and
lost: `sys.unraisablehook` drops it quietly and sends the signal again, to be handled in ordinary code. A Python
handler runs only when the main thread is back in Python, which can be minutes into a compile, and unwinding may be
slow: a thread woken by the signal itself (the wakeup fd) gives the process `GRACE_S` seconds, then prints the line
and exits 130 on its own. `ray.init` installs SIGTERM handlers of its own (Python's and its core worker's C++ one):
`install` again after it.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)
INTERRUPTED = 130  # cli.EXIT_CODES["interrupted"]
GRACE_S = 20.0  # from the signal to the exit at the latest: unwinding and releasing Ray take a few seconds

_state = {"line": "error: interrupted", "unwind": False, "printed": False, "exiting": False, "deadline": None,
          "watcher": None, "unraisablehook": None, "raised": None}
_lock = threading.RLock()  # a handler may run while the main thread holds it


class Interrupted(KeyboardInterrupt):
    """A SIGINT or SIGTERM during start-up."""


def install(line: str | None = None, unwind: bool | None = None) -> None:
    """Route SIGINT and SIGTERM to the start-up handler (again after a library replaced it). `line`: what the
    process prints when it ends on one; `unwind`: raise `Interrupted` (for `exit_now` to release what was started)
    rather than end at once (nothing started yet). Either left out: as given last."""
    if line is not None:
        _state["line"] = line
    if unwind is not None:
        _state["unwind"] = unwind
    for sig in SIGNALS:
        signal.signal(sig, _on_signal)
    if _state["watcher"] is None:
        _state["unraisablehook"], sys.unraisablehook = sys.unraisablehook, _unraisable
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        _state["watcher"] = threading.Thread(target=_watch, args=(read,), name="jaxflow-signals", daemon=True)
        _state["watcher"].start()


def installed() -> bool:
    """Whether the start-up handler holds SIGINT and SIGTERM."""
    return all(signal.getsignal(sig) is _on_signal for sig in SIGNALS)


def _on_signal(signum, frame):
    if _state["exiting"] or not _state["unwind"]:  # nothing to release, or a signal again while releasing
        _finish(INTERRUPTED)
    _state["raised"] = signum
    raise Interrupted(signum)  # args[0]: the signal


def raised() -> bool:
    """Whether the start-up handler raised `Interrupted`: an exception of another type after it is the interrupt
    turned into something else by a library's bare `except:` (JAX's make_mesh returns None from one and raises a
    ValueError)."""
    return _state["raised"] is not None


def _unraisable(unraisable) -> None:
    """An `Interrupted` that a finalizer swallowed: send its signal again from another thread, to be handled (once
    the finalizer has returned) in ordinary code."""
    if isinstance(unraisable.exc_value, Interrupted) and installed():
        again = threading.Timer(0.01, os.kill, (os.getpid(), unraisable.exc_value.args[0]))
        again.daemon = True
        again.start()
    else:
        _state["unraisablehook"](unraisable)


def _watch(fd: int) -> None:
    """Woken by every signal (Python's wakeup fd) while the main thread may be busy in C++: arm the deadline when
    the start-up handler holds the signal."""
    while os.read(fd, 64):
        if installed() or _state["exiting"]:
            arm()


def arm() -> None:
    """End the process with exit 130 `GRACE_S` seconds from now unless it ends sooner (once)."""
    with _lock:
        if _state["deadline"] is None:
            _state["deadline"] = threading.Timer(GRACE_S, _finish, (INTERRUPTED,))
            _state["deadline"].daemon = True
            _state["deadline"].start()


def exit_now(code: int, release=None) -> None:
    """Print the line, run `release` (bounded by the deadline), flush and end the process with `code`, skipping the
    interpreter's teardown."""
    _state["exiting"] = True
    arm()
    _print_line()
    if release is not None:
        try:
            release()
        except Exception:  # noqa: BLE001 - the process is ending; what it could not release, Ray reaps
            pass
    _finish(code)


def _print_line() -> None:
    with _lock:
        if not _state["printed"]:
            _state["printed"] = True
            print(_state["line"], file=sys.stderr, flush=True)


def _finish(code: int) -> None:
    _print_line()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe: nothing more to say
            pass
    os._exit(code)
