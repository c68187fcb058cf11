"""Sync verification (jaxflow/sync/verify.py, LoRASync.serve): stand-in engines that answer each LoRA sync with a
served probe computed as the contract says (jaxflow_bridge/contract/served.py) from what they hold. An engine that
keeps the old adapter, or binds fewer modules, is caught at the first sync after it; a mismatch a re-sync fixes
does not stop the run; the stop line names the engine, the version and the modules."""
import gc
import logging
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx

from jaxflow.families.qwen_image.loading import load_transformer
from jaxflow.families.qwen_image.lora import QwenImageLoRASpec as LoRASpec
from jaxflow.nn.lora import LoRAParam, lora_to_peft, peft_modules, peft_probe
from jaxflow.run.rollout_client import RolloutGroup
from jaxflow.sync.transport import LoRASync
from jaxflow.sync.verify import SyncMismatch, expected_of
from jaxflow_bridge.contract.lora import lora_pairs
from jaxflow_bridge.contract.lora_payload import LoRAPayload
from jaxflow_bridge.contract.served import (PROBE_MODULES, UNIT_ROUNDOFF, ServedProbe, expected_probe, probe_modules,
                                            probe_positions, product_tolerance)
from jaxflow_bridge.sync.sinks import make_sink
from jaxflow_bench.sync_verify import lora_state as sized_lora_state
from tests import HANG_S
from tests.helpers import ROOT

SPEC = LoRASpec(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def lora_state(tiny_path):
    state = nnx.state(load_transformer(tiny_path / "transformer", lora=SPEC), LoRAParam)
    return lambda seed: jax.tree.map(
        lambda x: jax.random.normal(jax.random.key(seed), x.shape, jnp.float32) * 0.3, state)


class Engine:
    """A stand-in engine holding the adapter it was sent in bf16, answering as the contract says. It acks every
    version but keeps serving the adapter it had from version `stale_from` on, and once for each of `miss_once`;
    `drop`: modules it never binds."""

    def __init__(self, stale_from=None, miss_once=(), drop=()):
        self.stale_from, self.miss_once, self.drop = stale_from, set(miss_once), set(drop)
        self.held, self.calls = {}, []

    def update_lora(self, tensors, version, config):
        self.calls.append(version)
        if version in self.miss_once or (self.stale_from is not None and version >= self.stale_from):
            self.miss_once.discard(version)
        else:
            pairs = lora_pairs(tensors)
            self.held = {m: tuple(x.astype(ml_dtypes.bfloat16).astype(np.float32) for x in ab)
                         for m, ab in pairs.items() if m not in self.drop}
        scale = LoRAPayload(version, config, tensors={}).scale
        deltas, tolerances = {}, {}
        for m in probe_modules(sorted(lora_pairs(tensors)), version):
            if m in self.held:
                a, b = self.held[m]
                rows, cols = probe_positions(m, (b.shape[0], a.shape[1]))
                deltas[m] = (scale * (b[rows] * a[:, cols].T).sum(1)).astype(np.float32).tolist()
                tolerances[m] = product_tolerance(a, b, scale, rows, cols, UNIT_ROUNDOFF["bfloat16"]).tolist()
        served = ServedProbe(version, len(self.held), deltas, tolerances)
        return {"version": version, "bound_modules": len(self.held), "served": served.to_dict()}


class MergedEngine:
    """A stand-in engine that merges what it is sent into bf16 weights of |W| in [1.5, 2) (the sinks' `MergedLoRA`),
    answering with the merged sink's own probe."""

    def __init__(self):
        self.sink, self.calls = None, []

    def update_lora(self, tensors, version, config):
        self.calls.append(version)
        payload = LoRAPayload(version, config, tensors=tensors)
        if self.sink is None:
            model = torch.nn.Module()
            for m, (a, b) in sorted(lora_pairs(tensors).items()):
                *path, leaf = m.split(".")
                parent = model
                for part in path:
                    if not hasattr(parent, part):
                        parent.add_module(part, torch.nn.Module())
                    parent = parent.get_submodule(part)
                linear = torch.nn.Linear(a.shape[1], b.shape[0], bias=False, dtype=torch.bfloat16)
                with torch.no_grad():
                    linear.weight.copy_(torch.sign(torch.randn(linear.weight.shape))
                                        * (1.5 + 0.5 * torch.rand(linear.weight.shape)))
                parent.add_module(leaf, linear)
            self.sink = make_sink("merged", model)
        self.sink.release()
        bound = self.sink.apply(payload)
        return {"version": version, "bound_modules": bound, "served": self.sink.served(payload).to_dict()}


class Transport:
    """Stand-in engines called in this process (the RolloutGroup's transport interface)."""

    max_servers, device_tensors = None, False

    def __init__(self, engines):
        self.engines = iter(engines)

    def start(self, config):
        return next(self.engines)

    def submit(self, server, method, *args):
        return getattr(server, method)(*args)

    def get(self, refs):
        return refs

    def retrying(self, fn, restart, started=True):
        return fn()

    def kill(self, server):
        pass


def sync(engines, **options):
    group = RolloutGroup({}, num_servers=len(engines), transport=Transport(engines))
    return LoRASync(group, SPEC, "ray", {"engine": "stand-in", "dtype": "bfloat16", "lora_apply": "layers"}, **options)


def test_the_expected_probe_reads_only_the_probed_modules_and_matches_the_peft_arrays(lora_state):
    lora = lora_state(0)
    names = peft_modules(lora, SPEC)
    pairs = lora_pairs(lora_to_peft(lora, SPEC))
    assert names == sorted(pairs) and len(names) == 24
    rows, cols = np.array([0, 5, 2]), np.array([1, 1, 3])
    picked = peft_probe(lora, SPEC, lambda m, shape: (rows, cols) if m in {names[3], names[10]} else None)
    assert sorted(picked) == [names[3], names[10]]
    for m, (a_cols, b_rows) in picked.items():  # only the probed columns of A and rows of B
        np.testing.assert_array_equal(a_cols, pairs[m][0][:, cols])
        np.testing.assert_array_equal(b_rows, pairs[m][1][rows])
    want = expected_of(lora, SPEC, 1)
    assert want.modules == 24 and sorted(want.deltas) == names  # 24 <= PROBE_MODULES: all probed


def test_the_one_program_probe_matches_the_contract_as_the_window_moves_and_compiles_once(caplog):
    """More modules than the probe reads, of three shapes (d -> d, d -> mlp, mlp -> d): at each version the probe
    of the device state, and of its host copy, is the contract's `expected_probe` of the PEFT arrays; after the
    first version no version compiles anything."""
    spec = LoRASpec(rank=4, alpha=8.0)
    lora = sized_lora_state(spec, layers=6, dim=8, mlp=24, seed=1)
    host = jax.device_get(lora)
    tensors = lora_to_peft(lora, spec)
    scale = LoRAPayload(0, spec.peft_config(), tensors={}).scale
    expected_of(lora, spec, 1)
    probed = set()
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        for version in range(2, 8):
            want = expected_of(lora, spec, version)
            contract = expected_probe(tensors, scale, version)
            assert want.modules == 72 and sorted(want.deltas) == sorted(contract) and len(contract) == PROBE_MODULES
            for m, values in contract.items():
                np.testing.assert_allclose(want.deltas[m], values, rtol=1e-12, atol=1e-300)
                np.testing.assert_array_equal(expected_of(host, spec, version).deltas[m], want.deltas[m])
            probed.update(want.deltas)
    assert len(probed) > PROBE_MODULES  # the window moved
    assert not [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]


def test_the_injected_fault_keeps_the_previous_version_on_the_host_not_on_the_device(lora_state):
    """The stale copy must take no device memory (at full size the update has none to spare): a sync with the fault
    armed leaves as many device bytes live as one without it (the stand-in group keeps the arrays sent, on the CPU
    views of device buffers: the baseline is a sync without the fault)."""
    def device_bytes():  # per buffer (a host view of one on the CPU is listed as another array of the same buffer)
        gc.collect()
        return sum({x.unsafe_buffer_pointer(): x.nbytes for x in jax.live_arrays()}.values())

    def kept(stale_from):
        s, lora = sync([Engine()], stale_from=stale_from), lora_state(2)
        before = device_bytes()
        s.serve(lora, 2)  # the version before stale_from: its LoRA is kept for the next sync
        return device_bytes() - before

    assert kept(3) == kept(0)
    engine = Engine()
    s = sync([engine], stale_from=3)
    s.serve(lora_state(1), 1)
    s.serve(lora_state(2), 2)
    with pytest.raises(SyncMismatch, match="does not serve version 3"):
        s.serve(lora_state(3), 3)


def test_a_healthy_engine_passes_every_sync_and_the_check_is_timed(lora_state):
    engines = [Engine(), Engine()]
    s = sync(engines)
    for version in (1, 2, 3):
        assert s.serve(lora_state(version), version) == 24
    assert s.mismatches == 0 and s.verify_s > 0
    assert engines[0].calls == engines[1].calls == [1, 2, 3]


def test_an_engine_that_keeps_the_old_adapter_is_caught_at_the_first_sync_after_it(lora_state, caplog):
    engines = [Engine(), Engine(stale_from=3)]  # from version 3 on the second engine keeps version 2's adapter
    s = sync(engines)
    s.serve(lora_state(1), 1)
    s.serve(lora_state(2), 2)
    with pytest.raises(SyncMismatch) as err:
        s.serve(lora_state(3), 3)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("LoRA sync check: stand-in engine 1 of 2 does not serve version 3: 24 of 24 probed "
                           "modules differ: ")
    assert "(+19 more), also after a re-sync" in line and "train.sync_verify=False" in line
    assert engines[1].calls == [1, 2, 3, 3] and s.mismatches == 2
    assert sum("syncing version 3 again" in r.getMessage() for r in caplog.records) == 1


def test_an_engine_that_binds_fewer_modules_is_caught(lora_state):
    names = peft_modules(lora_state(0), SPEC)
    s = sync([Engine(drop={names[5]}), Engine(drop={names[5]})])
    with pytest.raises(SyncMismatch, match=rf"stand-in engine 0 of 2 does not serve version 1: it binds 23 of the "
                                           rf"adapter's 24 modules; 1 of 24 probed modules differ: {names[5]}, also"):
        s.serve(lora_state(1), 1)


def test_a_transient_mismatch_that_the_re_sync_fixes_does_not_stop_the_run(lora_state, caplog):
    engines = [Engine(miss_once={2})]  # version 2 is missed once, then taken
    s = sync(engines)
    s.serve(lora_state(1), 1)
    assert s.serve(lora_state(2), 2) == 24
    assert s.serve(lora_state(3), 3) == 24
    assert engines[0].calls == [1, 2, 2, 3] and s.mismatches == 1
    assert [r.getMessage().split(": ")[0] for r in caplog.records if "again" in r.getMessage()] == ["LoRA sync check"]


def test_a_reply_without_a_probe_fails_unless_the_check_is_off(lora_state):
    class Blind(Engine):
        def update_lora(self, tensors, version, config):
            reply = super().update_lora(tensors, version, config)
            del reply["served"]
            return reply

    with pytest.raises(SyncMismatch, match="engine 0 of 1 does not serve version 1: its reply carries no served probe"):
        sync([Blind()]).serve(lora_state(1), 1)
    off = sync([Blind()], verify=False)
    assert off.serve(lora_state(1), 1) == 24 and off.verify_s is None


def caught_at_version_3(engine, lora, match: str) -> None:
    """The injected fault from version 3 on: versions 1 and 2 pass, 3 is sent twice (the re-sync) and stops."""
    s = sync([engine], stale_from=3)
    s.serve(lora(1), 1)
    s.serve(lora(2), 2)
    with pytest.raises(SyncMismatch, match=match):
        s.serve(lora(3), 3)
    assert engine.calls == [1, 2, 3, 3]


def test_the_injected_fault_sends_the_previous_version_and_is_caught_at_that_version(lora_state):
    caught_at_version_3(Engine(), lora_state, "does not serve version 3: 24 of 24 probed modules differ")


def test_a_merged_engine_sent_the_previous_version_is_caught_while_the_deltas_are_within_half_an_ulp(lora_state):
    """The GPU case at the sync's level: bf16 merged weights and a young adapter (version v's B is v times a small
    one: every delta within |W| / 256, half an ulp of W at most); the injected fault (the previous version sent from
    version 3 on) stops the run at version 3, and without it every version passes."""
    young = {}

    def lora(version):
        if not young:
            state = lora_state(5)
            peak = max(np.abs(v).max() for v in expected_probe(lora_to_peft(state, SPEC), 2.0, 1).values())
            young["b"] = jax.tree_util.tree_map_with_path(  # the largest delta of version 3 is 5e-3
                lambda p, x: x * (5e-3 / 3 / peak if "lora_b" in jax.tree_util.keystr(p) else 1.0), state)
        return jax.tree_util.tree_map_with_path(
            lambda p, x: x * (version if "lora_b" in jax.tree_util.keystr(p) else 1.0), young["b"])

    torch.manual_seed(0)
    healthy = sync([MergedEngine()])
    for version in (1, 2, 3):
        assert healthy.serve(lora(version), version) == 24
    assert healthy.mismatches == 0
    assert max(np.abs(v).max() for v in expected_of(lora(3), SPEC, 3).deltas.values()) < 1.5 / 256
    caught_at_version_3(MergedEngine(), lora, "does not serve version 3: ")


@pytest.mark.slow
def test_the_stop_is_one_line_and_exit_1(tmp_path):
    code = ("import sys; from jaxflow.run import cli; from jaxflow.sync.verify import SyncMismatch\n"
            "class T:\n"
            "    driver, start = None, 0\n"
            "    def __init__(self, cfg, resume=False): pass\n"
            "    def run(self): raise SyncMismatch('LoRA sync check: diffusers engine 0 of 1 does not serve version 3')\n"
            "    def close(self): pass\n"
            "sys.exit(cli.main(T))")
    out = subprocess.run([sys.executable, "-c", code, f"--config.run_dir={tmp_path / 'run'}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=HANG_S)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(err) == 1, out.stderr
    assert err[0] == (f"error: LoRA sync check: diffusers engine 0 of 1 does not serve version 3; the checkpoints in "
                      f"{tmp_path / 'run' / 'checkpoints'} are as they were")


@pytest.mark.slow
def test_a_real_run_verifies_every_sync_and_stops_at_the_first_stale_one(tmp_path):
    """The tiny run with the diffusers engine in process (its replies carry served probes: the engines' side of the
    check): a healthy step logs sync_verify_s and no mismatch; with the previous version's LoRA sent from version 2
    on, the run stops in step 1's sync, its first step after the fault, before that step's checkpoint."""
    from jaxflow.run.run_dir import checkpoint_steps
    from tests.helpers import run, tiny_config
    cfg = tiny_config(tmp_path / "ok", num_steps=1)
    cfg.rollout.layout = "in_process"
    row = run(cfg)["history"][0]
    assert row["sync_mismatches"] == 0 and 0 < row["sync_verify_s"]
    cfg = tiny_config(tmp_path / "stale", num_steps=3, sync_fault_from=2)
    cfg.rollout.layout = "in_process"
    cfg.checkpoint.every = 1
    with pytest.raises(SyncMismatch, match="engine 0 of 1 does not serve version 2: "):
        run(cfg)
    assert checkpoint_steps(tmp_path / "stale") == [1]
