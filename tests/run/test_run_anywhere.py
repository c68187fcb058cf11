"""The program runs from any working directory: config-relative data paths, an absolute --config, and a clone
named `jaxflow` seen from its parent folder (which must not shadow the package as a namespace package)."""
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
import pytest
from tests import HANG_S

ROOT = Path(__file__).resolve().parents[2]


def test_editable_install_puts_the_checkout_on_sys_path(tmp_path):
    """pyproject.toml makes `pip install -e .` a static .pth entry (the checkout), not an import hook: an entry on
    sys.path with a regular package `jaxflow/` wins over a folder `jaxflow/` in the working directory."""
    project = tmp_path / "jaxflow"
    for name in ("pyproject.toml", "README.md", "jaxflow/__init__.py", "jaxflow_bridge/__init__.py"):
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, project / name)
    code = f"from setuptools import build_meta; print(build_meta.build_editable({str(tmp_path)!r}))"
    wheel = subprocess.run([sys.executable, "-c", code], cwd=project, capture_output=True, text=True, check=True)
    with zipfile.ZipFile(tmp_path / wheel.stdout.strip().splitlines()[-1]) as zf:
        names = zf.namelist()
        pth = [zf.read(n).decode().strip() for n in names if n.endswith(".pth")]
    assert pth == [str(project)], pth
    assert not [n for n in names if n.endswith("finder.py")], names


@pytest.mark.slow
def test_train_from_the_clones_parent_folder(tmp_path):
    """`python -m jaxflow.train --config /abs/configs/tiny_ocr.py` from a folder holding the clone as `jaxflow/`,
    with the checkout on sys.path the way the editable install puts it; default data paths, 1 step."""
    parent = tmp_path / "parent"
    parent.mkdir()
    (parent / "jaxflow").symlink_to(ROOT, target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "jaxflow.train", "--config", str(ROOT / "configs" / "tiny_ocr.py"),
            f"--config.run_dir={run_dir}", "--config.train.num_steps=1", "--config.eval.every=1000",
            "--config.checkpoint.every=1000", "--config.log.progress=False", "--config.log.tensorboard=False",
            "--config.rollout.layout=in_process", "--config.reward.fns={'jpeg_incompressibility': 1.0}"]
    proc = subprocess.run(args, cwd=parent, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1]  # steps count completed updates
    assert (run_dir / "lora_final" / "adapter_config.json").exists()
