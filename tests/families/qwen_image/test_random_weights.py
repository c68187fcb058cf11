"""`model.init=random`: the trainer (JAX) and the rollout (torch) draw bit-identical base weights from one seed."""
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
import torch

from jaxflow.families.qwen_image.config import QwenImageConfig
from jaxflow.nn.config import ModelOptions
from jaxflow.families.qwen_image.loading import fingerprint, to_diffusers_state_dict
from jaxflow.families.qwen_image.random_init import random_transformer
from jaxflow_bridge.contract.random_weights import numpy_weight
from jaxflow_bridge.families.qwen_image.diffusers_pipeline import RolloutPipeline
from jaxflow_bridge.rollout.random_weights import torch_weight
from jaxflow_bridge.families.qwen_image.tiny import tiny_pipeline_path


@pytest.mark.parametrize("name, shape", [("blocks.0.attn.to_q.weight", (96, 160)), ("x.proj.weight", (7, 3, 5)),
                                         ("attn.norm_q.weight", (16,)), ("attn.to_q.bias", (16,))])
def test_torch_draw_equals_the_numpy_reference(name, shape):
    ref = numpy_weight(11, name, shape)
    got = torch_weight(11, name, shape, torch.float32, "cpu").numpy()
    np.testing.assert_array_equal(got, ref)
    if len(shape) > 1:  # uniform in [-1, 1) / sqrt(fan_in), and the seed and the name both change the stream
        bound = 1 / np.sqrt(np.prod(shape[1:]))
        assert -bound <= ref.min() < -0.9 * bound and 0.9 * bound < ref.max() < bound
        assert not np.array_equal(ref, numpy_weight(12, name, shape))
        assert not np.array_equal(ref, numpy_weight(11, name + "x", shape))


def test_rollout_and_trainer_draw_the_same_transformer(tmp_path):
    """A folder without transformer weights: the rollout pipeline draws them in bf16, the trainer in bf16 on its
    device; every tensor is bitwise equal (and equal to the numpy reference) and the fingerprints agree."""
    folder = tmp_path / "pipe"
    shutil.copytree(tiny_pipeline_path(), folder)
    for f in (folder / "transformer").glob("*.safetensors*"):
        f.unlink()
    pipe = RolloutPipeline.from_pretrained(folder, "bfloat16", "cpu", random_seed=5)
    cfg = QwenImageConfig.from_json(folder / "transformer" / "config.json")
    model = random_transformer(cfg, ModelOptions(dtype="bfloat16", param_dtype="bfloat16"), seed=5)
    ours, theirs = to_diffusers_state_dict(model), pipe.transformer.state_dict()
    assert set(ours) == set(theirs)
    for key, t in theirs.items():
        bits = t.view(torch.uint16).numpy()
        np.testing.assert_array_equal(np.asarray(ours[key]).view(np.uint16), bits, err_msg=key)
        np.testing.assert_array_equal(numpy_weight(5, key, tuple(t.shape), ml_dtypes.bfloat16).view(np.uint16), bits,
                                      err_msg=key)
    assert fingerprint(model) == pipe.fingerprint
    assert fingerprint(random_transformer(cfg, seed=6)) != pipe.fingerprint


def test_entries_of_one_shape_share_a_program_whatever_the_seed():
    """The key ids are the draw's argument: a model lowers one program per entry shape (not one per entry, each
    with its ids as constants), and another seed lowers none (three blocks: shapes no other test draws)."""
    from jaxflow_bridge.families.qwen_image import keymap
    cfg = QwenImageConfig(num_layers=3, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=64,
                          axes_dims_rope=(8, 12, 12))
    lowered = []

    def listen(event, secs, **kw):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration" and kw.get("fun_name") == "jit(draw)":
            lowered.append(secs)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        first = random_transformer(cfg, seed=1)
        drawn = len(lowered)
        second = random_transformer(cfg, seed=2)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert 0 < drawn < len(keymap.transformer_key_map()) and len(lowered) == drawn
    assert fingerprint(first) != fingerprint(second)
