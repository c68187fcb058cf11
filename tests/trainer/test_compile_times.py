"""The step's programs compile at once (`jaxflow.trainer.compile_times`, `executable_cache.compile_cached`): each is
traced and lowered in turn, then XLA compiles them in threads of their own, both in flight together; the start-up
line counts compiles that ran at once by their wall time and names the executable cache's loads "load"."""
import threading

import jax
import numpy as np
import pytest

from jaxflow.trainer import compile_times, executable_cache, start_options
from jaxflow.trainer.compile_times import CompileTime
from jaxflow.trainer.train_batch import TrainBatch
from jaxflow.trainer.train_step import make_train_step, prepare_batch
from tests.helpers import GRID, SEEDS, inputs
from jaxflow.trainer.step_config import TrainConfig
from tests.helpers_sampler import SamplerConfig, make_sampler

ADV = np.array([1.0, -1.0, 2.0, -0.5], np.float32)
# two updates a step, so the old-log-prob pass runs: the step has two programs
RECOMPUTE = TrainConfig(grid_hw=GRID, guidance=1.0, beta=0.04, old_log_prob="recompute", num_mini_batches=2,
                        num_micro_batches=1)
HANG_BOUND_S = 900  # a hang bound only: in flight together, the barrier opens at once


@pytest.fixture(scope="module")
def batch(lora_model):
    config = SamplerConfig(grid_hw=GRID, num_steps=6, noise_level=1.2, guidance=1.0, window_size=2)
    return TrainBatch(**make_sampler(lora_model, config)(inputs(False), SEEDS), advantages=ADV)


def _abstract(batch, config):
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in prepare_batch(batch, config).items()}


@pytest.mark.slow
def test_the_update_and_the_old_log_prob_pass_compile_at_once(lora_model, batch, monkeypatch):
    """Both of XLA's compiles wait at one barrier: it opens only when both are in flight together (compiled one
    after the other, the first would wait there alone); the step then runs them."""
    barrier, threads, compile_lowered = threading.Barrier(2, timeout=HANG_BOUND_S), [], compile_times.compile_lowered

    def meet(lowered):
        threads.append(threading.get_ident())
        barrier.wait()
        return compile_lowered(lowered)

    monkeypatch.setattr(executable_cache, "compile_lowered", meet)
    init_state, step = make_train_step(lora_model, RECOMPUTE)
    old = jax.eval_shape(step._old_pass, step.abstract_state().lora, step.frozen, _abstract(batch, RECOMPUTE))
    compiled = step.compile(_abstract(batch, RECOMPUTE), old)
    assert sorted(compiled) == ["old_log_prob", "update"] and len(set(threads)) == 2
    assert threading.get_ident() not in threads
    assert [t.name for t in step.compile_times] == ["update", "old_log_prob"]
    assert all(t.trace > 0 and t.lower > 0 and t.compile > 0 and not t.loaded for t in step.compile_times)
    _, metrics = step(init_state(), batch)  # runs the executables compiled in the threads
    assert int(metrics["skipped"]) == 0


def test_compiles_at_once_count_by_wall_time_and_loads_are_named():
    times = [CompileTime("update", 20.2, 30.4, 40.0, False, span=(100.0, 140.0)),
             CompileTime("old_log_prob", 5.0, 6.0, 30.0, True, span=(110.0, 140.0))]
    assert compile_times.summary(times) == ("trace 25 s, lower 36 s, compile 40 s; 1 of 2 compiles from the "
                                            "cache, 0 of 2 from the executable cache")
    loads = [CompileTime("update", 0.0, 0.0, 0.0, False, loaded=True, load=3.0, span=(0.0, 3.0)),
             CompileTime("old_log_prob", 0.0, 0.0, 0.0, False, loaded=True, load=2.0, span=(1.0, 3.0))]
    assert compile_times.summary(loads) == ("trace 0 s, lower 0 s, compile 0 s, load 3 s; 0 of 2 compiles from "
                                            "the cache, 2 of 2 from the executable cache")
    assert compile_times.wall([(0, 2), (1, 3), (5, 6)]) == 4
    assert compile_times.summary([CompileTime("a", 1, 1, 7, False), CompileTime("b", 1, 1, 8, False)]).startswith(
        "trace 2 s, lower 2 s, compile 15 s;")  # without spans: one after the other


def test_start_options_only_on_a_gpu_and_only_those_xla_knows(monkeypatch):
    assert not start_options.known("xla_no_such_option", True)
    assert start_options.known("xla_gpu_experimental_aot_compiled_thunks", True)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert start_options.with_start_options({"xla_gpu_enable_triton_gemm": False}) == \
        {"xla_gpu_enable_triton_gemm": False}
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(start_options, "GPU_OPTIONS", {"xla_gpu_experimental_aot_compiled_thunks": True,
                                                       "xla_no_such_option": True})
    assert start_options.with_start_options({"xla_gpu_experimental_aot_compiled_thunks": False}) == \
        {"xla_gpu_experimental_aot_compiled_thunks": False}  # train.xla_options' value wins
    assert start_options.with_start_options({}) == {"xla_gpu_experimental_aot_compiled_thunks": True}


def test_the_plan_line_lists_the_start_options_on_a_gpu(monkeypatch, tmp_path):
    """The plan stage adds them (`make_plan`), so the plan's XLA options line shows what the step compiles with."""
    from jaxflow.config import validation
    from jaxflow.trainer import learner
    from jaxflow.trainer.sharding import Layout
    from tests.helpers import tiny_config

    cfg = validation.validate(tiny_config(tmp_path))
    layout = Layout.create(validation.sharding_config(cfg))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    plan = learner.run_plan(cfg, validation.model_folder(cfg), layout)
    assert plan.xla_options["xla_gpu_experimental_aot_compiled_thunks"] is True
    assert "'xla_gpu_experimental_aot_compiled_thunks': True" in plan.summary()


def test_the_summary_names_the_autotune_results_an_earlier_run_left(tmp_path):
    """A compile that neither cache serves still reads XLA's per-fusion autotune cache, which JAX keeps in its
    persistent cache's folder: the summary says how many results it held, so that a start that missed both caches
    but found an earlier run's tuning is not read as cold; with that cache off it says nothing of it."""
    tuned = tmp_path / compile_times.AUTOTUNE_CACHE
    tuned.mkdir()
    for name in ("a.textproto", "b.textproto", "c.textproto"):
        (tuned / name).write_text("result")
    times = [CompileTime("update", 1.0, 1.0, 9.0, False)]
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_enable_xla_caches")
    before = {key: getattr(jax.config, key) for key in keys}
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path))
        jax.config.update("jax_persistent_cache_enable_xla_caches", compile_times.AUTOTUNE_CACHE)
        assert compile_times.autotune_results() == 3
        assert compile_times.summary(times, compile_times.autotune_results()).endswith(
            "0 of 1 from the executable cache, XLA's autotune cache held 3 results")
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "fresh"))
        assert compile_times.autotune_results() == 0  # a fresh cache folder: the compiles were cold
        jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
        assert compile_times.autotune_results() is None
    finally:
        for key, value in before.items():
            jax.config.update(key, value)
    assert compile_times.summary(times).endswith("0 of 1 from the executable cache")
