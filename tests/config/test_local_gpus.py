"""The GPUs the plan sizes for are those this process sees: nvidia-smi's, filtered by CUDA_VISIBLE_DEVICES."""
import subprocess

import pytest

from jaxflow.config import machine

SMI = ("0, GPU-aad55ff2-76d1, NVIDIA H200, 143771\n"
       "1, GPU-4fbfd58d-f128, NVIDIA H200, 143771\n")


@pytest.fixture
def smi(monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=SMI))
    return monkeypatch


@pytest.mark.parametrize("env, count", [(None, 2), ("0", 1), ("1,0", 2), ("GPU-4fbf", 1), ("0,7,1", 1), ("", 0),
                                        ("-1", 0)])
def test_visible_devices_count(smi, env, count):
    if env is None:
        smi.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        smi.setenv("CUDA_VISIBLE_DEVICES", env)
    found = machine.local_gpus()
    if count == 0:
        assert found is None
    else:
        card, n = found
        assert n == count and card.name == "NVIDIA H200" and card.memory_gib == pytest.approx(143771 / 1024)


def test_visible_keeps_cuda_order():
    rows = [["0", "GPU-a", "A", "10"], ["1", "GPU-b", "B", "20"]]
    assert [r[2] for r in machine.visible(rows, "1,0")] == ["B", "A"]
    assert machine.visible(rows, "0,1") == rows and machine.visible(rows, "2") == []


def test_result_device_names_the_visible_gpus(smi):
    from jaxflow_bench.results import device_name
    smi.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert device_name() == "NVIDIA H200, 143771 MiB"
    smi.delenv("CUDA_VISIBLE_DEVICES")
    assert device_name() == "2 x NVIDIA H200, 143771 MiB"
