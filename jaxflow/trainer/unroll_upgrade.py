"""model.unroll_upgrade (jaxflow/config/plan.py `unroll_upgrade`): a run that starts on the blocks in a scan builds
and compiles its unrolled train step in a background thread beside its first steps; `Learner.train` swaps to it at
the first step boundary after it is ready.

The thread gets a `build` that makes the step from an abstract copy of the model as it will run
(`Family.abstract_unrolled`: no array copied), compiles it through the learner's own compile path (the executable
cache and XLA's persistent cache serve a warm run) and checks its memory analysis against JAX's pool. What it raises
(a failed compile, `MemoryError` where the step does not fit) is kept for the swap, which then leaves the run on the
scanned step with one warning. The thread is a daemon: a run that ends first does not wait for the compile."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

# how every upgrade that does not happen ends its warning
KEEPS_SCAN = "the run keeps the blocks in a scan (model.unroll_upgrade='off' starts there without trying)"


class Background:
    """`build()` run once in a thread of its own, started at construction; `ready` once it returned or raised."""

    def __init__(self, build: Callable[[], object]):
        self.result = self.error = None
        self.seconds = 0.0  # the build's, once ready
        self.beside: list[int] = []  # the steps (1-based) that ran while it built, in order
        self._began = time.monotonic()
        self._thread = threading.Thread(target=self._run, args=(build,), name="unroll-upgrade", daemon=True)
        self._thread.start()

    def _run(self, build: Callable[[], object]) -> None:
        try:
            self.result = build()
        except Exception as exc:  # noqa: BLE001 - any failure keeps the scanned step (the swap warns once)
            self.error = exc
        self.seconds = time.monotonic() - self._began

    @property
    def ready(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()

    def steps(self) -> str:
        """The steps that ran beside the build: "steps 3-7", "step 3" or "no step"."""
        if not self.beside:
            return "no step"
        first, last = self.beside[0], self.beside[-1]
        return f"step {first}" if first == last else f"steps {first}-{last}"

    def problem(self) -> str:
        """The warning for a build that raised: what it was and its first line."""
        what = ("does not fit JAX's pool" if isinstance(self.error, MemoryError)
                else f"failed to compile ({type(self.error).__name__})")
        first = (str(self.error).splitlines() or [""])[0][:300]
        return f"upgrade: the unrolled blocks' step {what}: {first}; {KEEPS_SCAN}"
