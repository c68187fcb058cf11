"""The served-weights probe's contract: positions fixed by name and shape, a window of modules that moves with the
version, and tolerances that admit an engine's rounding but not a stale adapter."""
import ml_dtypes
import numpy as np

from jaxflow_bridge.contract.served import (ServedProbe, differing, expected, merged_tolerance, probe_modules,
                                            probe_positions, product_tolerance)


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
    tol = product_tolerance(a, b, 2.0, rows, cols, "bfloat16", rounded=True)
    probe = ServedProbe(3, 1, {"m": served.tolist()}, {"m": tol.tolist()})
    assert differing({"m": expected(a, b, 2.0, rows, cols)}, probe) == []
    b_new = b + 0.05 * rng.normal(size=b.shape)  # the next version; the engine still serves the old one
    assert differing({"m": expected(a, b_new, 2.0, rows, cols)}, probe) == ["m"]
    assert differing({"m": expected(a, b, 2.0, rows, cols), "n": np.zeros(3)}, probe) == ["n"]  # not reported


def test_merged_bf16_within_half_an_ulp():
    rng = np.random.default_rng(1)
    a, b = _pair(rng)
    base = (rng.normal(size=(48, 40)) * 0.02).astype(ml_dtypes.bfloat16)
    delta = (b @ a).astype(np.float32)
    merged = (base.astype(np.float32) + delta).astype(ml_dtypes.bfloat16)
    rows, cols = probe_positions("m", base.shape)
    served = merged.astype(np.float32)[rows, cols] - base.astype(np.float32)[rows, cols]
    tol = merged_tolerance(merged.astype(np.float32)[rows, cols], "bfloat16", delta[rows, cols])
    want = expected(a, b, 1.0, rows, cols)
    assert np.all(np.abs(served - want) <= tol)
    stale = base.astype(np.float32)[rows, cols] * 0  # an engine that merged nothing serves a zero delta
    probe = ServedProbe(1, 0, {"m": stale.tolist()}, {"m": tol.tolist()})
    assert differing({"m": want}, probe) == ["m"]
    assert ServedProbe.from_dict(probe.to_dict()) == probe


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
