"""The served-weights probe's contract: positions fixed by name and shape, a window of modules that moves with the
version, and tolerances that admit an engine's rounding but not a stale adapter."""
import ml_dtypes
import numpy as np

from jaxflow_bridge.contract.served import (UNIT_ROUNDOFF, ServedProbe, differing, expected, merged_error,
                                            probe_modules, probe_positions, product_tolerance, round_to)


def _pair(rng, out=48, inp=40, r=4, scale=1.0):
    return rng.normal(size=(r, inp)) * 0.1, rng.normal(size=(out, r)) * 0.1


def test_positions_are_fixed_by_name_and_shape():
    a = probe_positions("blocks.0.attn.to_q", (48, 40))
    b = probe_positions("blocks.0.attn.to_q", (48, 40))
    c = probe_positions("blocks.0.attn.to_k", (48, 40))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], c[0])
    assert a[0].max() < 48 and a[1].max() < 40


def test_the_module_window_moves_with_the_version_and_covers_every_module():
    names = [f"m{i:03d}" for i in range(100)]
    assert probe_modules(names[:10], 3) == names[:10]
    seen = set()
    for version in range(4):
        picked = probe_modules(names, version, limit=32)
        assert len(picked) == 32
        seen.update(picked)
    assert seen == set(names)


def test_bf16_layers_within_tolerance_and_a_stale_adapter_outside():
    rng = np.random.default_rng(0)
    a, b = _pair(rng)
    rows, cols = probe_positions("m", b.shape[:1] + a.shape[1:])
    a16, b16 = (x.astype(ml_dtypes.bfloat16).astype(np.float32) for x in (a, b))
    served = (2.0 * (b16[rows] * a16[:, cols].T).sum(1)).astype(np.float32)
    tol = product_tolerance(a, b, 2.0, rows, cols, UNIT_ROUNDOFF["bfloat16"])
    probe = ServedProbe(3, 1, {"m": served.tolist()}, {"m": tol.tolist()})
    assert differing({"m": expected(a, b, 2.0, rows, cols)}, probe) == []
    b_new = b + 0.05 * rng.normal(size=b.shape)  # the next version; the engine still serves the old one
    assert differing({"m": expected(a, b_new, 2.0, rows, cols)}, probe) == ["m"]
    assert differing({"m": expected(a, b, 2.0, rows, cols), "n": np.zeros(3)}, probe) == ["n"]  # not reported


def test_round_to_rounds_to_nearest_even_as_each_dtype_does():
    """Against ml_dtypes' bfloat16 and numpy's float16 / float32 casts (each one rounding of a float32, or float64,
    value): random values over the whole exponent range, ties exactly between two neighbours, subnormals, overflow."""
    rng = np.random.default_rng(4)
    bits = rng.integers(0, 2 ** 32, 20000, dtype=np.uint64).astype(np.uint32)
    x32 = bits.view(np.float32)
    x32 = x32[np.isfinite(x32)]
    b16 = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    b16 = b16[np.isfinite(b16)]
    halfway = (b16.view(np.uint32) + np.uint32(0x8000)).view(np.float32)  # exactly between b16 and its neighbour
    f16 = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    f16 = f16[np.isfinite(f16)]
    f16_halfway = (f16.astype(np.float64) + np.ldexp(1.0, np.maximum(np.frexp(f16.astype(np.float64))[1] - 1, -14)
                                                    - 11)).astype(np.float32)
    for x in (x32, halfway[np.isfinite(halfway)], np.array([3.4e38, -3.39e38, 1e-40, 65520.0, 65519.0, 6e-8])):
        np.testing.assert_array_equal(round_to(x, "bfloat16"), x.astype(ml_dtypes.bfloat16).astype(np.float64))
    for x in (x32, f16_halfway, np.array([65520.0, 65519.0, 6e-8, 3e-8, 2.9e-8], np.float32)):
        with np.errstate(over="ignore"):
            np.testing.assert_array_equal(round_to(x, "float16"), x.astype(np.float16).astype(np.float64))
    x64 = rng.normal(size=5000) * np.exp2(rng.integers(-160, 130, 5000))
    x64 = np.concatenate([x64, x32.astype(np.float64) * (1 + 2.0 ** -24)])
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(round_to(x64, "float32"), x64.astype(np.float32).astype(np.float64))
    assert round_to(1 + 2.0 ** -8, "bfloat16") == 1.0 and round_to(1 + 3 * 2.0 ** -8, "bfloat16") == 1 + 2.0 ** -6


def _merged_engine(base: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """What a bf16 engine serves: W_base + delta in float32, rounded once to bf16 (as `addmm_` does)."""
    return (base.astype(np.float32) + delta.astype(np.float32)).astype(ml_dtypes.bfloat16).astype(np.float64)


def _merged_probe(base, served, a, b, rows, cols) -> ServedProbe:
    magnitude = np.einsum("kr,rk->k", np.abs(b[rows]), np.abs(a[:, cols]))
    tol = merged_error(base, magnitude, a.shape[0], 0.0)
    return ServedProbe(1, 1, {"m": (served - base).tolist()}, {"m": tol.tolist()}, {"m": base.tolist()},
                       {"m": "bfloat16"})


def test_merged_bf16_predicts_the_served_weight_and_its_rounding_at_ties():
    """Deltas of up to a few ulps: the served weight is predicted; one ulp off at one position is caught; a weight
    whose W_base + delta is a tie, or within the arithmetic's error of one, passes whichever way the engine rounds."""
    rng = np.random.default_rng(1)
    a, b = _pair(rng)
    rows, cols = probe_positions("m", (48, 40))
    base = (rng.normal(size=64) * 0.5).astype(ml_dtypes.bfloat16).astype(np.float64)
    want = expected(a, b, 1.0, rows, cols)
    served = _merged_engine(base, want)
    probe = _merged_probe(base, served, a, b, rows, cols)
    assert differing({"m": want}, probe) == []
    assert ServedProbe.from_dict(probe.to_dict()) == probe
    ulp = np.ldexp(1.0, np.frexp(served)[1] - 8)
    off = served.copy()
    off[7] += ulp[7]
    assert differing({"m": want}, _merged_probe(base, off, a, b, rows, cols)) == ["m"]
    half_ulp = np.sign(base) * np.ldexp(1.0, np.frexp(base)[1] - 9)  # W_base + half_ulp: between two neighbours
    assert np.all(base != 0)

    def tied(delta, served):
        tol = merged_error(base, np.abs(half_ulp), 4, 0.0)
        probe = ServedProbe(1, 1, {"m": (served - base).tolist()}, {"m": tol.tolist()}, {"m": base.tolist()},
                            {"m": "bfloat16"})
        return differing({"m": delta}, probe)

    for delta in (half_ulp, half_ulp * (1 + 2.0 ** -30), half_ulp * (1 - 2.0 ** -30)):  # at a tie, or within
        for served in (base, base + 2 * half_ulp, _merged_engine(base, delta)):  # the error of one: either way
            assert tied(delta, served) == []
    beyond = half_ulp * (1 + 2.0 ** -6)  # off the tie by more than the arithmetic's error: the nearer neighbour
    assert tied(beyond, base + 2 * half_ulp) == [] and tied(beyond, base) == ["m"]


def test_positions_beyond_float32_are_not_compared_and_a_served_nan_is_caught():
    """A diverged adapter (a runaway learning rate) has deltas no float32 engine can hold: those positions are the
    divergence checks' to stop, not the sync check's; a NaN served where the value is representable is a mismatch."""
    rng = np.random.default_rng(2)
    a, b = _pair(rng)
    rows, cols = probe_positions("m", (48, 40))
    big = expected(a * 1e25, b * 1e25, 1.0, rows, cols)
    assert np.all(np.isnan(big))
    inf = ServedProbe(1, 1, {"m": [float("inf")] * len(rows)}, {"m": [1.0] * len(rows)})
    assert differing({"m": big}, inf) == []
    want = expected(a, b, 1.0, rows, cols)
    nan = ServedProbe(1, 1, {"m": [float("nan")] + list(want[1:])}, {"m": [1e-6] * len(rows)})
    assert differing({"m": want}, nan) == ["m"]
