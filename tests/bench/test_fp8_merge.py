"""jaxflow_bench.fp8_merge at its tiny size: FP8 rounding as vLLM's per-tensor scale does it, and what each way of
serving the LoRA over FP8 weights serves."""
import json

import pytest
import torch

from jaxflow_bench import fp8_merge as fm


def test_quantize_keeps_the_largest_value_and_three_mantissa_bits():
    w = fm.weight("gauss", 64, 48, torch.Generator().manual_seed(1))
    scale = w.abs().max() / fm.FP8_MAX
    back = fm.dequantize(fm.quantize(w, scale), scale)
    assert float(back.abs().max()) == pytest.approx(float(w.abs().max()), rel=1e-6)
    normal = w.abs() > 2 ** -6 * scale  # below it float8_e4m3fn is subnormal: an absolute step, not a relative one
    assert float(((back - w).abs() / w.abs())[normal].max()) <= 2 ** -4 * (1 + 1e-6)  # half of 2^-3


@pytest.fixture(scope="module")
def figures():
    return fm.measure("tiny", seed=0)


@pytest.mark.parametrize("dist", fm.DISTS)
def test_a_merge_from_an_fp8_copy_drops_a_small_adapter(figures, dist):
    # from grid points, a term below half an FP8 step rounds back to the same weight: nothing served
    assert figures[f"{dist}/rho_1e-04/merge_fp8_adapter_err"] > 0.95
    errs = [figures[f"{dist}/rho_{r:.0e}/merge_fp8_adapter_err"] for r in fm.RHOS]
    assert errs == sorted(errs, reverse=True) and errs[-1] < 0.5


@pytest.mark.parametrize("dist", fm.DISTS)
def test_a_merge_from_a_bf16_copy_is_as_close_as_the_layers(figures, dist):
    for r in fm.RHOS:
        layers, merged = (figures[f"{dist}/rho_{r:.0e}/{k}"] for k in ("layers_rel", "merge_bf16_rel"))
        assert 0.005 < layers < 0.06  # FP8's rounding: a relative step of 2^-3, about 2.7% RMS
        assert merged == pytest.approx(layers, rel=0.1)
    # but its adapter is re-rounded whole: at a small adapter, many times the adapter's own size
    assert figures[f"{dist}/rho_1e-04/merge_bf16_adapter_err"] > 3


def test_main_writes_its_figures(tmp_path):
    fm.main(["--out", str(tmp_path), "--size", "tiny"])
    written = json.loads((tmp_path / "fp8_merge.json").read_text())
    assert written["name"] == "fp8_merge" and written["size"] == "tiny"
    assert set(written["figures"]) == {f"{d}/rho_{r:.0e}/{k}" for d in fm.DISTS for r in fm.RHOS for k in (
        "layers_rel", "merge_fp8_rel", "merge_bf16_rel", "merge_fp8_adapter_err", "merge_bf16_adapter_err")}
