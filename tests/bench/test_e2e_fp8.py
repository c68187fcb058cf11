"""The FP8 rollout's benchmark on the CPU: jaxflow_bench.e2e --quantization fp8 sets the trainer's
rollout.quantization and names its result e2e_recipe_fp8_LAYOUT, and its figures (`summary.mismatch_figures`: the
log-prob mismatch's p50 / p99 and rollout correction's rejected share) come out of synthetic metrics rows."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxflow_bench.e2e import described, parser, result_name, setup
from jaxflow_bench.summary import mismatch_figures, summarize
from tests import HANG_S
from tests.helpers import ROOT


def row(step: int, means, maxes, rejected=None) -> dict:
    r = {"step": step, "time/step": 10.0, "time/rollout": 4.0 + step, "time/reward": 1.0, "time/train": 4.0,
         "time/sync": 0.5, "images_per_s": 1.6}
    r.update({f"logp_diff_mean/{i}": v for i, v in enumerate(means)})
    r.update({f"logp_diff_max/{i}": v for i, v in enumerate(maxes)})
    if rejected is not None:
        r["rejected_frac"] = rejected
    return r


def test_mismatch_figures_of_synthetic_metrics():
    """p50 of the window steps' means, p99 of their maxima (numpy's linear percentile over steps x window steps),
    the largest, and the median step's rejected share; nothing where the rows log no mismatch (DiffusionNFT)."""
    rows = [row(1, [0.01, 0.03], [0.1, 0.5], 0.0), row(2, [0.02, 0.04], [0.2, 0.3], 0.25),
            row(3, [0.05, 0.06], [0.4, 0.9], 0.5)]
    got = mismatch_figures(rows)
    assert got["logp_diff_max"] == 0.9
    assert got["logp_diff_p50"] == pytest.approx(0.035)  # median of 0.01 .. 0.06
    assert got["logp_diff_p99"] == pytest.approx(np.percentile([0.1, 0.5, 0.2, 0.3, 0.4, 0.9], 99))
    assert 0.8 < got["logp_diff_p99"] < 0.9 and got["rejected_share"] == 0.25
    assert "rejected_share" not in mismatch_figures([row(1, [0.01], [0.1])])
    assert mismatch_figures([{"step": 1}]) == {}


def test_summary_of_a_run_writes_the_fp8_figures(tmp_path):
    """summarize (what e2e writes) carries them beside img_per_gpu_s and rollout_s, over the steps after the first."""
    rows = [row(1, [9.0], [9.0], 1.0), row(2, [0.02], [0.2], 0.1), row(3, [0.04], [0.6], 0.3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    figures = summarize(tmp_path)
    assert figures["img_per_gpu_s"] == 1.6 and figures["rollout_s"] == 6.5
    assert figures["logp_diff_max"] == 0.6 and figures["logp_diff_p50"] == pytest.approx(0.03)
    assert figures["rejected_share"] == pytest.approx(0.2)


@pytest.mark.slow
def test_e2e_fp8_sets_the_rollout_quantization_and_names_its_result(tmp_path):
    args, _ = parser().parse_known_args([str(tmp_path / "out"), "--quantization", "fp8"])
    cmd, _, _, _ = setup(args, dict(os.environ))
    assert "--config.rollout.quantization=fp8" in cmd and "--config.rollout.engine=vllm_omni" in cmd
    assert result_name(args) == "e2e_recipe_fp8_1gpu"
    plain, _ = parser().parse_known_args([str(tmp_path / "out")])
    assert result_name(plain) == "e2e_vllm_omni_1gpu"
    assert not [a for a in setup(plain, dict(os.environ))[0] if "quantization" in a]


def test_e2e_fp8_refuses_the_diffusers_engine(tmp_path):
    got = subprocess.run([sys.executable, "-m", "jaxflow_bench.e2e", str(tmp_path / "out"), "--quantization", "fp8",
                          "--engine", "diffusers"], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert (got.returncode, got.stderr.strip()) == (2, "error: --quantization fp8 quantizes vLLM-Omni's DiT: a GPU "
                                                       "run without --engine diffusers")
    assert not (tmp_path / "out").exists()


def test_the_result_command_names_the_quantization(tmp_path):
    """The result file's command reruns what ran: an FP8 run's names --quantization=fp8, a bf16 run's none."""
    args, _ = parser().parse_known_args([str(tmp_path / "out"), "--quantization", "fp8", "--steps", "3"])
    assert "--quantization=fp8" in described(args, [], {}).split()
    plain, _ = parser().parse_known_args([str(tmp_path / "out")])
    assert "--quantization" not in described(plain, [], {})


@pytest.mark.slow
def test_e2e_pins_the_long_runs_unrolled_blocks(tmp_path):
    """A benchmark's few steps would get the plan's short-run start (blocks in a scan, jaxflow/config/planner.py
    short_start): the recipe's e2e run pins the unrolled blocks of its long run, which BAGEL (XLA's linears, its
    blocks scanned anyway) and a CPU run of the tiny recipe (its own scan_unroll) are not given."""
    from jaxflow_bench.e2e import UNROLLED

    args, _ = parser().parse_known_args([str(tmp_path / "out")])
    assert UNROLLED in setup(args, dict(os.environ))[0]
    bagel, _ = parser().parse_known_args([str(tmp_path / "b"), "--recipe", "bagel"])
    assert UNROLLED not in setup(bagel, dict(os.environ))[0]
    cpu, _ = parser().parse_known_args([str(tmp_path / "c"), "--device", "cpu", "--config", "configs/tiny_ocr.py",
                                        "--layout", "inproc"])
    assert UNROLLED not in setup(cpu, dict(os.environ))[0]
