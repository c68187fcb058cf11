"""The executable cache (`jaxflow.trainer.executable_cache`): a train step made anew loads its compiled update
without tracing and runs it bit for bit as the traced one; a changed program, arguments or source misses; an
unreadable entry is a miss with a warning, then replaced."""
import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jaxflow.families.qwen_image.transformer import QwenImageTransformer
from jaxflow.nn.config import ModelOptions
from jaxflow.families.qwen_image.lora import QwenImageLoRASpec as LoRASpec
from jaxflow.trainer import executable_cache
from jaxflow.trainer.step_config import TrainConfig
from jaxflow.trainer.train_batch import TrainBatch
from jaxflow.trainer.train_step import make_train_step, prepare_batch
from tests.helpers import GRID, SEEDS, TINY, inputs
from tests.helpers_sampler import SamplerConfig, make_sampler
from tests import HANG_S

ROOT = Path(__file__).resolve().parents[2]

PLAIN = TrainConfig(grid_hw=GRID, guidance=1.0, num_micro_batches=2, beta=0.04)  # tests/trainer/test_train_step.py's
SPEC = LoRASpec(rank=4, alpha=8.0, targets=("to_q", "to_v", "img_mlp.net.2"))  # tests.helpers.tiny_lora_model's
ADV = np.array([1.0, -1.0, 2.0, -0.5], np.float32)


@pytest.fixture(scope="module")
def batch(lora_model):
    config = SamplerConfig(grid_hw=GRID, num_steps=6, noise_level=1.2, guidance=1.0, window_size=2)
    return TrainBatch(**make_sampler(lora_model, config)(inputs(False), SEEDS), advantages=ADV)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The cache in `tmp_path`, on for this CPU (off there by default: a CPU executable cannot run in a new process;
    in this process it can, so the keying and loading are tested here)."""
    monkeypatch.setattr(executable_cache, "BACKENDS", (jax.default_backend(),))
    before = executable_cache.folder()
    executable_cache.use(tmp_path)
    yield tmp_path
    executable_cache.use(before)


def _abstract(batch, config):
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in prepare_batch(batch, config).items()}


def _compiled(model, batch, config=PLAIN):
    init_state, step = make_train_step(model, config)
    step.compile(_abstract(batch, config), None)
    return init_state, step


def _key(step, batch, config=PLAIN):
    return executable_cache.key("update", step.program, (step.abstract_state(), step.frozen,
                                                         _abstract(batch, config), None,
                                                         jax.ShapeDtypeStruct((), np.int32)))


@pytest.mark.slow
def test_a_step_made_anew_loads_its_update_without_tracing(lora_model, batch, cache):
    lowered = []

    def listen(event, secs, **kw):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration" and "_update" in kw.get("fun_name", ""):
            lowered.append(secs)

    init_first, first = _compiled(lora_model, batch)
    assert [t.loaded for t in first.compile_times] == [False] and len(list(cache.glob("update-*.exe"))) == 1
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        init_again, again = _compiled(lora_model, batch)
        [update] = again.compile_times
        outputs = [step(init(), batch) for init, step in ((init_first, first), (init_again, again))]
        jax.block_until_ready(outputs)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert update.loaded and update.trace == update.lower == 0 and not lowered, (update, lowered)
    (a, b) = (jax.tree.leaves(jax.tree.map(np.asarray, out)) for out in outputs)
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    assert int(outputs[1][1]["skipped"]) == 0


def test_a_changed_program_arguments_or_source_change_the_key(lora_model, batch, monkeypatch):
    _, step = make_train_step(lora_model, PLAIN)
    base = _key(step, batch)
    assert _key(make_train_step(lora_model, PLAIN)[1], batch) == base  # the same step made anew
    clipped = dataclasses.replace(PLAIN, clip_range=2e-4)  # closed over by the update, not an argument
    assert _key(make_train_step(lora_model, clipped)[1], batch, clipped) != base
    for opts, spec in ((ModelOptions(remat="full"), SPEC),  # the graphdef's static attributes, the same shapes
                       (ModelOptions(), dataclasses.replace(SPEC, alpha=16.0)),
                       (ModelOptions(), dataclasses.replace(SPEC, rank=2))):
        other = QwenImageTransformer(TINY, opts, spec, rngs=nnx.Rngs(0))
        assert _key(make_train_step(other, PLAIN)[1], batch) != base, (opts, spec)
    longer = dataclasses.replace(batch, prompt_embeds=np.concatenate([batch.prompt_embeds] * 2, axis=1),
                                 prompt_mask=np.concatenate([batch.prompt_mask] * 2, axis=1))
    assert _key(step, longer) != base
    monkeypatch.setattr(executable_cache, "source_digest", lambda: "another source")
    assert _key(step, batch) != base


@pytest.mark.slow
def test_an_unreadable_entry_is_a_miss_with_a_warning_and_is_replaced(lora_model, batch, cache, caplog):
    _compiled(lora_model, batch)
    [entry] = cache.glob("update-*.exe")
    entry.write_bytes(entry.read_bytes()[:1000])  # cut short, as by a full disk
    with caplog.at_level(logging.WARNING, logger=executable_cache.__name__):
        _, again = _compiled(lora_model, batch)
    assert [t.loaded for t in again.compile_times] == [False]
    assert [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()] != []
    _, third = _compiled(lora_model, batch)
    assert [t.loaded for t in third.compile_times] == [True] and list(cache.glob("update-*.exe")) == [entry]


def test_off_on_the_cpu(lora_model, batch, tmp_path):
    before = executable_cache.folder()
    executable_cache.use(tmp_path)
    try:
        _, step = _compiled(lora_model, batch)
    finally:
        executable_cache.use(before)
    assert jax.default_backend() != "cpu" or (not step.compile_times[0].loaded and not list(tmp_path.iterdir()))


def _partitioned_program_check(folder: str):
    """In a subprocess with 2 CPU devices: a jit with a custom-partitioned op (as cuDNN's attention is over several
    GPUs) is stored, then loaded by the next lookup and runs as compiled."""
    import jax.numpy as jnp
    from jax.experimental.custom_partitioning import custom_partitioning
    from jax.sharding import NamedSharding, PartitionSpec as P

    @custom_partitioning
    def double(x):
        return 2 * x

    double.def_partition(partition=lambda mesh, args, out: (mesh, lambda x: 2 * x, out.sharding, (args[0].sharding,)),
                         infer_sharding_from_operands=lambda mesh, args, out: args[0].sharding,
                         sharding_rule="i j -> i j")
    rows = NamedSharding(jax.make_mesh((2,), ("b",)), P("b"))
    fn = jax.jit(lambda x: double(x) + 1, in_shardings=rows, out_shardings=rows)
    executable_cache.BACKENDS = ("cpu",)
    executable_cache.use(Path(folder))
    calls = {"double": (fn, jax.ShapeDtypeStruct((4, 3), np.float32, sharding=rows))}
    first = executable_cache.compile_cached(calls, "double-test")
    again = executable_cache.compile_cached(calls, "double-test")
    assert [t.loaded for _, t in (first["double"], again["double"])] == [False, True]
    x = jax.device_put(np.arange(12, dtype=np.float32).reshape(4, 3), rows)
    np.testing.assert_array_equal(np.asarray(again["double"][0](x)), 2 * np.asarray(x) + 1)
    print("PARTITIONED_OK")


def test_a_program_with_a_custom_partitioned_op_is_stored_and_loaded(tmp_path):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    code = f"import tests.trainer.test_executable_cache as t; t._partitioned_program_check({str(tmp_path)!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=HANG_S)
    assert proc.returncode == 0 and "PARTITIONED_OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "cannot store" not in proc.stderr, proc.stderr[-3000:]
