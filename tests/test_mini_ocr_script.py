"""`SMOKE=1 bash scripts/mini_ocr.sh OUT`: every step of the mini OCR proof at toy size on the CPU (about 2 minutes on
2 cores), from the rendered data to OUT/mini_ocr.json with the figures the proof reports."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["data", "vae", "encode", "pretrain", "eval_before", "eval_before_train", "rl", "rl_control", "eval_after",
         "eval_after_train", "eval_control", "result"]


def test_the_script_runs_every_step_and_writes_the_result(tmp_path):
    # the fewest training steps and eval images that still run every step's code (this test checks the plumbing;
    # tests/test_learning.py checks that RL learns)
    env = {**os.environ, "SMOKE": "1", "JAX_PLATFORMS": "cpu", "VAE_STEPS": "10", "PRETRAIN_STEPS": "5",
           "EVAL_NUM": "4",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "mini_ocr.sh"), str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    timed = [line.split()[0] for line in (tmp_path / "timings.txt").read_text().splitlines()]
    assert timed == STEPS
    result = json.loads((tmp_path / "mini_ocr.json").read_text())
    figures = result["figures"]
    for key in ("ocr_before", "ocr_after", "ocr_before_se", "ocr_after_se", "ocr_control_after", "rl_steps",
                "rl_minutes"):
        assert key in figures, key
    assert figures["rl_steps"] == 2 and len(result["reward_curve"]) == len(result["control_reward_curve"]) == 2
    for run in ("rl", "rl_control"):
        assert (tmp_path / run / "lora_final" / "adapter_config.json").exists()
    assert (tmp_path / "reward_curve.png").stat().st_size > 0
