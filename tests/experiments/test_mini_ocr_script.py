"""`SMOKE=1 bash experiments/mini_ocr/run.sh OUT`: every step of the mini OCR proof at toy size on the CPU (about
2 minutes on 2 cores), from the rendered data to OUT/mini_ocr.json with the figures the proof reports; then
`experiments/mini_ocr/arms.sh` training three algorithm arms on that pipeline, two at once (two "GPUs" of CPU), and
`experiments/mini_ocr/sweep.sh` two FlowGRPO and two NFT variants, two at a time on one "GPU" (PER_GPU=2)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests import HANG_S

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["data", "vae", "encode", "pretrain", "eval_before", "eval_before_train", "rl", "rl_control", "eval_after",
         "eval_after_train", "eval_control", "result"]
# the fewest training steps and eval images that still run every step's code (these tests check the plumbing;
# tests/run/test_learning.py checks that RL learns)
ENV = {**os.environ, "SMOKE": "1", "JAX_PLATFORMS": "cpu", "VAE_STEPS": "10", "PRETRAIN_STEPS": "5", "EVAL_NUM": "4",
       "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def script(name: str, out: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "experiments" / "mini_ocr" / name), str(out)], cwd=ROOT,
                          env={**ENV, **env}, capture_output=True, text=True, timeout=HANG_S)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The whole proof at toy size in OUT/p0 (every eval also at 3 steps): the layout experiments/mini_ocr/arms.sh
    reuses."""
    out = tmp_path_factory.mktemp("mini_ocr")
    return out, script("run.sh", out / "p0", EVAL_ALSO_STEPS="3")


@pytest.mark.slow
def test_the_script_runs_every_step_and_writes_the_result(built):
    out, done = built
    out = out / "p0"
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    timed = [line.split()[0] for line in (out / "timings.txt").read_text().splitlines()]
    assert timed == STEPS
    result = json.loads((out / "mini_ocr.json").read_text())
    figures = result["figures"]
    for key in ("ocr_before", "ocr_after", "ocr_before_se", "ocr_after_se", "ocr_control_after", "rl_steps",
                "rl_minutes"):
        assert key in figures, key
    assert figures["rl_steps"] == 2 and len(result["reward_curve"]) == len(result["control_reward_curve"]) == 2
    for run in ("rl", "rl_control"):
        assert (out / run / "lora_final" / "adapter_config.json").exists()
    assert (out / "reward_curve.png").stat().st_size > 0
    for name in ("before", "after", "control", "after_train"):  # each eval also at 3 steps, beside the 4-step one
        at4, at3 = (json.loads((out / "eval" / f"{name}{tag}.json").read_text()) for tag in ("", "_s3"))
        assert (at4["steps"], at3["steps"], at3["n"], at3["lora"]) == (4, 3, at4["n"], at4["lora"]), name
        assert (out / "eval" / f"{name}_s3.png").stat().st_size > 0


@pytest.mark.slow
def test_the_arms_launcher_trains_each_arm_on_the_built_pipeline_and_collects_them(built):
    out, first = built
    assert first.returncode == 0, first.stderr[-3000:]
    (out / "p0" / "eval" / "before_nft.json").unlink(missing_ok=True)  # the sweep test's, where it ran first
    done = script("arms.sh", out, GPUS="2", PIPELINES="1", ARMS="guard cfgfree nft", RL_STEPS="1",
                  EVAL_ALSO_STEPS="3")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    status = (out / "status").read_text().splitlines()
    runs = [line for line in status if line.startswith("run ")]
    assert sorted(line.split()[:3] for line in runs) == [["run", "p0", arm] for arm in ("cfgfree", "guard", "nft")]
    assert {line.split()[3] for line in runs} == {"gpu=0", "gpu=1"}  # side by side, one a "GPU"
    assert [line.split()[:2] for line in status if not line.startswith("run ")] == [["nft_before", "p0"]]  # once
    figures = json.loads((out / "mini_ocr_algorithms.json").read_text())["figures"]
    assert figures["guard/pipelines"] == figures["nft/pipelines"] == 1 and figures["nft/steps"] == 1
    # FlowGRPO without CFG rises from NFT's CFG-free "before", and its eval samples without CFG too
    before_cfg_free = json.loads((out / "p0" / "eval" / "before_nft.json").read_text())
    after_cfgfree = json.loads((out / "p0" / "eval" / "after_cfgfree.json").read_text())
    assert figures["cfgfree/before"] == pytest.approx(before_cfg_free["mean"]) and figures["cfgfree/steps"] == 1
    assert after_cfgfree["guidance"] == 1.0 and (out / "p0" / "rl_cfgfree" / "lora_final").is_dir()
    assert figures["flowgrpo/pipelines"] == 1  # the proof's own FlowGRPO run is collected too
    assert (out / "p0" / "eval" / "before_nft.json").exists() and (out / "p0" / "rl_guard" / "lora_final").is_dir()
    at3 = json.loads((out / "mini_ocr_algorithms_s3.json").read_text())["figures"]  # the same runs' 3-step evals
    before_nft = json.loads((out / "p0" / "eval" / "before_nft_s3.json").read_text())
    assert at3["nft/before"] == pytest.approx(before_nft["mean"]) and before_nft["guidance"] == 1.0
    assert at3["guard/steps"] == figures["guard/steps"] and at3["flowgrpo/pipelines"] == 1
    bad = script("arms.sh", out, ARMS="ppo")
    assert bad.returncode == 2 and "unknown arm ppo" in bad.stderr


@pytest.mark.slow
def test_the_sweep_runs_its_variants_side_by_side_with_their_overrides_and_pairs_them_with_their_arm(built):
    out, first = built
    assert first.returncode == 0, first.stderr[-3000:]
    (out / "p0" / "eval" / "before_nft.json").unlink(missing_ok=True)  # the arms test's, where it ran first
    done = script("sweep.sh", out, GPUS="1", PER_GPU="2", PIPELINES="1", VARIANTS="baseline lr2x nft nft_decay0",
                  RL_STEPS="1")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    status = (out / "status").read_text().splitlines()
    assert [line.split()[:3] for line in status if line.startswith("nft_before ")] == [["nft_before", "p0", "gpu=0"]]
    assert sorted(line.split()[:4] for line in status if line.startswith("run ")) == [
        ["run", "p0", name, "gpu=0"] for name in ("baseline", "lr2x", "nft", "nft_decay0")]
    result = json.loads((out / "mini_ocr_sweep.json").read_text())
    figures = result["figures"]
    assert figures["baseline/pipelines"] == figures["lr2x/pipelines"] == 1 and figures["lr2x/steps"] == 1
    assert figures["lr2x/rise_vs_baseline"] == pytest.approx(figures["lr2x/rise"] - figures["baseline/rise"], abs=2e-6)
    assert result["variants"]["lr2x"]["overrides"] == ["--config.train.learning_rate=0.0006"]
    # NFT's variants rise from its CFG-free "before" and pair with the NFT arm as configured, not FlowGRPO's
    before_nft = json.loads((out / "p0" / "eval" / "before_nft.json").read_text())["mean"]
    assert figures["nft/before"] == pytest.approx(before_nft) and result["variants"]["nft_decay0"]["arm"] == "nft"
    assert figures["nft_decay0/rise_vs_nft"] == pytest.approx(figures["nft_decay0/rise"] - figures["nft/rise"],
                                                              abs=2e-6)
    assert "nft_decay0/rise_vs_baseline" not in figures and "nft/rise_vs_baseline" not in figures
    for name, lr in (("baseline", 3e-4), ("lr2x", 6e-4)):
        meta = json.loads((out / "p0" / f"rl_sweep_{name}" / "checkpoints" / "1" / "meta" / "metadata").read_text())
        assert json.loads(meta["config"])["train"]["learning_rate"] == pytest.approx(lr)
    for name, cap in (("nft", 0.999), ("nft_decay0", 0.0)):
        meta = json.loads((out / "p0" / f"rl_sweep_{name}" / "checkpoints" / "1" / "meta" / "metadata").read_text())
        train = json.loads(meta["config"])["train"]
        assert train["algorithm"] == "nft" and train["nft"]["decay_max"] == pytest.approx(cap), train.get("nft")
    bad = script("sweep.sh", out, VARIANTS="lr9x")
    assert bad.returncode == 2 and "unknown sweep variant 'lr9x'" in bad.stderr
