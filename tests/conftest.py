"""Shared fixtures: one local Ray instance per session and the cached tiny Qwen-Image folder.

The session's JAX processes (this one and every trainer a test starts) share one persistent compilation cache in
a folder of the session's own, set before JAX is imported: many tests compile the same tiny train step, and on 2
cores the compiles are much of the suite's time. A fresh folder per session keeps the tests independent of
earlier runs."""

import atexit
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jaxflow-tests-xla-cache-")
    atexit.register(shutil.rmtree, _cache, True)
    os.environ.update(JAX_COMPILATION_CACHE_DIR=_cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.2",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


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
