"""Profiling the real run: the block's named regions reach the compiled program, and the `profile` section traces
exactly the configured steps."""
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxflow.families.qwen_image.config import QwenImageConfig
from jaxflow.nn.config import ModelOptions
from jaxflow.families.qwen_image.transformer import QwenImageTransformer
from jaxflow.run.profiling import StepProfiler
from jaxflow_bench.kernels import scope_of, with_hlo_dump

TINY = QwenImageConfig(num_layers=2, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=64,
                       axes_dims_rope=(8, 12, 12))


@pytest.mark.parametrize("unroll", [1, 2])  # the blocks in a scan, and unrolled
def test_block_regions_are_named_in_the_compiled_program(unroll):
    model = QwenImageTransformer(TINY, ModelOptions(scan_unroll=unroll), rngs=nnx.Rngs(0))
    x, txt = jnp.zeros((1, 4, 64)), jnp.zeros((1, 3, 64))
    text = jax.jit(lambda x, t: model(x, jnp.full((1,), 0.5), t, None, (2, 2))).lower(x, txt).as_text(
        debug_info=True)
    for region in ("modulation", "attention", "mlp"):  # each region's matmuls carry its name
        assert re.search(rf'loc\("(?:[^"]*/)?{region}/dot_general"', text), region


def _traces(folder):
    return sorted(folder.rglob("*.xplane.pb"))


def test_profiler_traces_only_the_configured_steps(tmp_path):
    profiler, f = StepProfiler(start_step=2, num_steps=2, out_dir=tmp_path / "p"), jax.jit(lambda a: a @ a)
    a = jnp.ones((8, 8))
    for step in (1, 2, 3, 4):
        profiler.begin(step)
        assert profiler.active == (step in (2, 3))
        out = f(a)
        profiler.end(step, out)
        assert not profiler.active or step == 2
    assert len(_traces(tmp_path / "p")) == 1
    off = StepProfiler(start_step=2, num_steps=0, out_dir=tmp_path / "off")
    for step in (1, 2, 3):
        off.begin(step)
        off.end(step)
    assert not off.active and not (tmp_path / "off").exists()


def test_profile_config_is_validated(tmp_path):
    from jaxflow.config import validation as config_lib
    from tests.helpers import tiny_config

    cfg = tiny_config(tmp_path)
    cfg.profile.num_steps = -1
    with pytest.raises(ValueError, match=r"config\.profile"):
        config_lib.validate(cfg)


def test_the_train_step_profile_dumps_the_hlo_that_names_its_scopes(tmp_path):
    flags = with_hlo_dump("--xla_gpu_enable_command_buffer=", tmp_path / "hlo")
    assert flags.startswith("--xla_gpu_enable_command_buffer= ") and f"--xla_dump_to={tmp_path / 'hlo'}" in flags
    assert "--xla_dump_hlo_as_text" in flags
    assert with_hlo_dump("--xla_dump_to=/elsewhere", tmp_path) == "--xla_dump_to=/elsewhere"


def test_kernels_are_put_in_their_block_scope_looped_or_unrolled():
    names = {"a": "jit(_update)/while/body/eval_jaxpr/checkpoint/attention/dot_general",
             "b": "jit(_update)/while/body/eval_jaxpr/jvp(mlp)/dot_general",
             "c": "jit(_update)/while/body/transpose(jvp(modulation))/mul",
             "d": "jit(_update)/while/body/jit(dynamic_index_in_dim)/dynamic_slice",
             "e": "jit(_update)/while/body/mlp_gate/add"}
    got = {k: scope_of({"hlo_op": k}, names) for k in names}
    assert got == {"a": "attention", "b": "mlp", "c": "modulation", "d": "outside the scopes",
                   "e": "outside the scopes"}
