"""model.unroll_upgrade in the learner (`Learner.start_upgrade`, `Learner.train`): the tiny model starts on its blocks
in a scan, the unrolled step compiles in a background thread and takes over at a step boundary, and the run then
trains as one unrolled from the start; a build that fails to compile or does not fit keeps the scanned step, with
one warning. 'on' stands for the plan's choice: the tiny model on the CPU is no case of 'auto'."""
import logging

import jax
import numpy as np
import pytest

from jaxflow.config import validation
from jaxflow.trainer import learner as learner_lib
from jaxflow.trainer import memory, train_step
from tests.helpers import random_train_batch, tiny_config

STEPS = 3


def _learner(tmp_path, upgrade: str):
    raw = tiny_config(tmp_path / upgrade)
    # a 4-sample batch, one window step, no CFG: a small program, seconds to compile
    raw.sample.update(prompts_per_step=2, group_size=2, prompts_per_call=2, window_size=1, guidance=1.0)
    raw.model.update(scan_unroll=100, lora_gemm="xla", unroll_upgrade=upgrade)  # unrolled blocks, as planned
    # XLA's CPU backend without its costlier passes: quicker compiles, the same programs in every run here
    raw.train.xla_options = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
    cfg = validation.validate(raw)
    learner = learner_lib.Learner(cfg, validation.model_folder(cfg))
    learner.check_memory()
    learner.begin(resume=False)
    return learner


def _train(learner, steps: int, wait_after: int | None = None) -> list[dict]:
    """`steps` steps on seeded random batches; the background build awaited after step `wait_after`."""
    rows = []
    for step in range(steps):
        rows.append(learner.train(random_train_batch(learner, seed=step), version=step))
        if step + 1 == wait_after:
            learner.wait_upgrade()
    return rows


@pytest.mark.slow
def test_the_swap_trains_as_a_run_unrolled_from_the_start(tmp_path, caplog):
    upgraded = _learner(tmp_path, "on")
    assert upgraded.plan.upgrade is not None and upgraded.model.opts.scan_unroll == 1
    before = jax.tree.map(np.asarray, upgraded.state.lora)  # host copies: the state is donated
    upgraded.start_upgrade()
    with caplog.at_level(logging.INFO, "jaxflow.train"):
        rows = _train(upgraded, STEPS, wait_after=1)
    assert [r["upgraded"] for r in rows] == [0, 1, 1]
    assert upgraded.model.opts.scan_unroll == 100 and upgraded.model.blocks_unstacked
    swaps = [r.message for r in caplog.records if r.message.startswith("upgrade:")]
    assert len(swaps) == 1 and " s beside step 1; step 2 on, the weights unstacked in " in swaps[0], swaps
    assert " s (trace " in swaps[0], swaps
    # the background compile is counted apart: the start-up's compiles are the scanned step's alone
    assert [t.name for t in upgraded.compile_times] == [t.name for t in upgraded.upgrade_compile_times] == ["update"]
    assert upgraded.compile_times[0] is not upgraded.upgrade_compile_times[0]

    unrolled = _learner(tmp_path, "off")
    assert unrolled.plan.upgrade is None and unrolled.model.opts.scan_unroll == 100
    plain = _train(unrolled, STEPS)
    # the same program: the one the upgrade compiled in the background serves it from XLA's persistent cache
    assert [t.cached for t in unrolled.compile_times] == [True], unrolled.compile_times
    assert "upgraded" not in plain[0]
    # float32, the same sums in another order (a scan against straight-line blocks): each Adam update moves a weight
    # by at most about the learning rate, and a gradient's reordering changes it by a relative ~1e-6 (1e-3 allowed);
    # each update also rounds the weight (an ulp, 2^-23 relative, twice allowed). A block run on wrong weights would
    # differ by whole updates.
    lr = upgraded.cfg.train.learning_rate
    for a, b in zip(jax.tree.leaves(upgraded.state.lora), jax.tree.leaves(unrolled.state.lora)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=STEPS * 2 ** -22, atol=STEPS * lr * 1e-3)
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in plain], rtol=1e-5)
    moved = max(float(np.max(np.abs(np.asarray(a) - b)))
                for a, b in zip(jax.tree.leaves(upgraded.state.lora), jax.tree.leaves(before)))
    assert moved > 100 * STEPS * lr * 1e-3  # the steps trained: the comparison above is not of two unmoved LoRAs


def _kept_scanned(learner, caplog) -> str:
    """Two steps after a failed build: both on the scanned step, the failure warned once (returned)."""
    with caplog.at_level(logging.WARNING, "jaxflow.train"):
        rows = _train(learner, 2)
    assert [r["upgraded"] for r in rows] == [0, 0] and learner.model.opts.scan_unroll == 1
    warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING and "upgrade:" in r.message]
    assert len(warnings) == 1, warnings
    assert warnings[0].endswith("; the run keeps the blocks in a scan (model.unroll_upgrade='off' starts there "
                                "without trying)")
    return warnings[0]


def test_a_failed_compile_keeps_the_scanned_step(tmp_path, monkeypatch, caplog):
    learner = _learner(tmp_path, "on")

    def fails(calls, program):
        raise RuntimeError("XLA: resource exhausted while compiling\nmore detail")

    monkeypatch.setattr(train_step.executable_cache, "compile_cached", fails)
    learner.start_upgrade()
    learner.wait_upgrade()
    monkeypatch.undo()
    warning = _kept_scanned(learner, caplog)
    assert "failed to compile (RuntimeError): XLA: resource exhausted while compiling;" in warning


@pytest.mark.slow
def test_a_step_that_does_not_fit_keeps_the_scanned_step(tmp_path, monkeypatch, caplog):
    """The CPU keeps no memory statistics: a pool of 1 MiB stands in, which the unrolled step cannot fit."""
    learner = _learner(tmp_path, "on")
    monkeypatch.setattr(memory, "pool", lambda device=None: (2 ** 20, 0))
    learner.start_upgrade()
    learner.wait_upgrade()
    monkeypatch.undo()
    warning = _kept_scanned(learner, caplog)
    assert "does not fit JAX's pool: train step memory per device (" in warning and "GiB short)" in warning


@pytest.mark.slow
def test_weights_the_host_has_no_room_for_keep_the_scanned_step(tmp_path, monkeypatch, caplog):
    """The swap holds the frozen weights on the host while it unstacks them: with 1 MiB available it does not begin,
    and the scanned step trains on, its weights untouched."""
    learner = _learner(tmp_path, "on")
    learner.start_upgrade()
    learner.wait_upgrade()
    monkeypatch.setattr(memory, "host_available", lambda: 2 ** 20)
    warning = _kept_scanned(learner, caplog)
    assert "the swap holds the frozen weights on the host, " in warning and ", 0.0 GiB available;" in warning
    assert not learner.model.blocks_unstacked
