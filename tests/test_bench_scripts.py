"""Benchmark scripts' code paths at toy size on the CPU (their figures come from GPU runs, BENCHMARKS.md)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_attention_bench_writes_its_result_file(tmp_path):
    subprocess.run([sys.executable, "scripts/bench_attention.py", "--tiny", "--out", str(tmp_path)], cwd=ROOT,
                   check=True, capture_output=True, timeout=600)
    record = json.loads((tmp_path / "attention_cudnn.json").read_text())
    assert {"name", "command", "device", "date", "figures"} <= set(record)
    figures = record["figures"]
    assert figures["xla_no_mask_fwd_ms"] > 0 and figures["xla_no_mask_fwd_bwd_ms"] > 0


def test_pallas_gemm_bench_writes_its_result_file(tmp_path):
    run = subprocess.run([sys.executable, "scripts/bench_pallas_gemm.py", "--tiny", "--out", str(tmp_path)], cwd=ROOT,
                         check=True, capture_output=True, text=True, timeout=600)
    assert "pallas: skipped, the Hopper kernel needs an H100 or H200" in run.stdout  # CPU: the XLA columns only
    figures = json.loads((tmp_path / "pallas_gemm.json").read_text())["figures"]
    assert set(figures) == {f"{c}_64x32x128" for c in ("xla", "xla+c", "xla_notriton", "xla_bT_notriton")}
    assert all(v > 0 for v in figures.values())


def test_lora_gemm_bench_writes_its_result_file(tmp_path):
    run = subprocess.run([sys.executable, "scripts/bench_lora_gemm.py", "--tiny", "--out", str(tmp_path)], cwd=ROOT,
                         check=True, capture_output=True, text=True, timeout=600)
    assert "fused: skipped, the kernel needs an H100 or H200" in run.stdout  # CPU: the XLA columns only
    figures = json.loads((tmp_path / "lora_gemm.json").read_text())["figures"]
    assert set(figures) == {f"{c}_{n}_ms_128x128x256" for c in ("fwd", "bwd") for n in ("base", "xla")}
    assert all(v > 0 for v in figures.values())


def test_mini_ocr_breakdown_counts_prompts_by_score_and_change():
    sys.path.insert(0, str(ROOT / "scripts"))
    from mini_ocr_result import breakdown

    before, after = [0.0, 0.0, 0.5, 1.0, 0.75], [0.0, 0.25, 1.0, 0.75, 0.75]
    assert breakdown(before, after) == dict(before=dict(zero=2, partial=2, perfect=1),
                                            after=dict(zero=1, partial=3, perfect=1), rose=2, fell=1, same=2)
    with pytest.raises(ValueError, match="evaluate the same prompts"):
        breakdown(before, after[:4])
