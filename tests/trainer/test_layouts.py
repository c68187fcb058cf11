"""The colocated layout on the CPU: N host devices train data-parallel on the step that N rollout actors sampled
(prompt chunks round-robin over them), and the LoRA after a step equals the one-device, one-actor run's."""
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import ROOT, cluster_free_env, final_lora
from tests import HANG_S


def _run(run_dir, devices: int, servers: int, address: str):
    flags = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}").strip()
    args = [sys.executable, "-m", "jaxflow.train", "--config", str(ROOT / "configs" / "tiny_ocr.py"),
            f"--config.run_dir={run_dir}", "--config.train.num_steps=1", "--config.eval.every=1000",
            "--config.log.progress=False", "--config.log.tensorboard=False", "--config.rollout.num_cpus=0",
            f"--config.rollout.num_servers={servers}", f"--config.rollout.address={address}",
            # Adam's first step is lr * g / (|g| + eps): eps 1e-6 keeps the reassociation of a data-parallel sum
            # on near-zero gradient entries below 1e-6 in the LoRA (eps 1e-8 amplifies it up to ~1e-4)
            "--config.train.adam_eps=1e-6", "--config.reward.fns={'jpeg_incompressibility': 1.0}"]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S,
                          env=cluster_free_env(XLA_FLAGS=flags))


@pytest.mark.slow
def test_two_devices_and_two_engines_train_like_one(ray_session, tmp_path):
    address = ray_session.get_runtime_context().gcs_address
    runs = {n: _run(tmp_path / f"n{n}", n, n, address) for n in (1, 2)}
    for n, out in runs.items():
        assert out.returncode == 0, f"{n} devices: {out.stderr[-3000:]}"
    one, two = final_lora(tmp_path / "n1"), final_lora(tmp_path / "n2")
    assert one.keys() == two.keys()
    for k in one:
        np.testing.assert_allclose(two[k], one[k], atol=1e-6, rtol=0, err_msg=k)
