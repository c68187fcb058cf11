"""Shared fixtures: one local Ray instance per session and the cached tiny Qwen-Image folder; and, at the end of
a run, the fast-tier tests that took longer than FAST_TEST_REPORT_S (a report, not a failure: times vary by machine).

The session's JAX processes (this one and every trainer a test starts) share one persistent compilation cache in
a folder of the session's own, set before JAX is imported: many tests compile the same tiny train step, and on 2
cores the compiles are much of the suite's time. A fresh folder per session keeps the tests independent of
earlier runs."""

import atexit
import os
import shutil
import tempfile
from collections import Counter

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jaxflow-tests-xla-cache-")
    atexit.register(shutil.rmtree, _cache, True)
    os.environ.update(JAX_COMPILATION_CACHE_DIR=_cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.2",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")

# A fast-tier test (setup, call and teardown, the fixtures it starts first included) longer than this is named at the
# end of the run: README's fast tier stays within its bound while few tests take this long (make it quicker or mark it
# slow, the tier that starts whole pipelines).
FAST_TEST_REPORT_S = 15
_fast_seconds = Counter()


def pytest_runtest_logreport(report):
    if "slow" not in report.keywords:
        _fast_seconds[report.nodeid] += report.duration


def pytest_terminal_summary(terminalreporter):
    long = [(s, n) for n, s in _fast_seconds.items() if s > FAST_TEST_REPORT_S]
    if long:
        terminalreporter.section(f"fast-tier tests over {FAST_TEST_REPORT_S} s (make them quicker or mark them slow)")
        for seconds, nodeid in sorted(long, reverse=True):
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}")


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray instance with 2 CPUs, no dashboard, shared by every test that needs Ray."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=200 * 2**20,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1"}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_path():
    """The tiny random Qwen-Image pipeline folder (float32), built on first use."""
    from jaxflow_bridge.families.qwen_image.tiny import tiny_pipeline_path

    return tiny_pipeline_path()


@pytest.fixture(scope="module")
def lora_model():
    """tests.helpers.tiny_lora_model(): the tiny fp32 DiT with non-zero LoRA params, one per test module."""
    from tests.helpers import tiny_lora_model

    return tiny_lora_model()
