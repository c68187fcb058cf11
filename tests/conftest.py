"""Shared fixtures: one local Ray instance per session and the cached tiny Qwen-Image folder."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


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
    from bridge.rollout.tiny import tiny_pipeline_path

    return tiny_pipeline_path()
