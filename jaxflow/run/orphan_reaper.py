"""Ends the processes a trainer started when it dies without stopping them (kill -9, the OOM killer).

Ray stops its local cluster's head processes with the driver (fate-sharing), but the raylet's two agents
(DashboardAgent, RuntimeEnvAgent) then spend a minute or more reporting the raylet's death to the dead GCS before
they exit. A watcher process, started with the cluster, notes the trainer's processes every second and kills those
still running once the trainer is gone.

    python -m jaxflow.run.orphan_reaper   # started by `start()`, as the trainer's child
"""
from __future__ import annotations

import os
import subprocess
import sys
import time


def start() -> None:
    """Start this process's watcher (its own session, so a Ctrl-C at the terminal leaves it to see the end)."""
    subprocess.Popen([sys.executable, "-m", "jaxflow.run.orphan_reaper"], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def watch(interval_s: float = 1.0) -> None:
    """Until the parent process ends (this process is then re-parented), note its descendants; then kill those
    still running (psutil checks each one's start time, so a reused pid is left alone)."""
    import psutil

    parent, me, seen = os.getppid(), os.getpid(), {}
    while os.getppid() == parent:
        try:
            seen.update((p.pid, p) for p in psutil.Process(parent).children(recursive=True) if p.pid != me)
        except psutil.Error:  # the parent ended between the check and the listing
            break
        time.sleep(interval_s)
    for proc in seen.values():
        try:
            if proc.is_running():
                proc.kill()
        except psutil.Error:
            continue


if __name__ == "__main__":
    watch()
