"""The edit recipe end to end: configs/qwen_edit_ocr.py:tiny trains the tiny Qwen-Image-Edit through Ray on the CPU
(diffusers engine), its edit-OCR reward scoring each edit against its source image and target."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests import HANG_S
from tests.helpers import ROOT, cluster_free_env


@pytest.mark.slow
def test_tiny_edit_recipe_trains_two_steps_through_ray(tmp_path):
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "jaxflow.train", "--config", "configs/qwen_edit_ocr.py:tiny",
            "--config.train.num_steps=2", f"--config.run_dir={run_dir}", "--config.eval.every=2",
            "--config.log.progress=False", "--config.log.tensorboard=False"]
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S, env=cluster_free_env())
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/edit_ocr" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # scored, not failed: a conditioned reward without its sources would score 0 as an error
        assert r["reward_errors"] == 0 and math.isfinite(r["reward/edit_ocr"]) and math.isfinite(r["reward_mean"])
    evals = [r for r in rows if "eval_reward/edit_ocr" in r]
    assert evals and all(math.isfinite(r["eval_reward/edit_ocr"]) for r in evals)
    assert (run_dir / "lora_final" / "adapter_model.safetensors").is_file()
