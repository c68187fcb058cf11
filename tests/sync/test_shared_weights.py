"""rollout.share_weights: the in-process diffusers engine serves the trainer's base weights, one copy in memory.

Bridge side (jaxflow_bridge/rollout/shared_weights.py): a transformer built without weights takes given tensors as
its parameters, not copied, checked first. Trainer side (jaxflow/sync/base_share.py): the JAX model's arrays reach the
engine as DLPack views, and the loop runs on them."""
import jax
import numpy as np
import pytest
from flax import nnx

from jaxflow.config import validation as config_lib
from jaxflow.train import Trainer
from jaxflow_bridge.engines.diffusers import DiffusersEngine
from jaxflow_bridge.families.qwen_image.diffusers_pipeline import RolloutPipeline
from tests.helpers import tiny_config

SAMPLING = dict(height=40, width=72, num_inference_steps=3, true_cfg_scale=4.0, noise_level=1.2, sde_window_size=2,
                sde_window_range=(0, 2), max_sequence_length=32)


def engine(tiny_path, base):
    return DiffusersEngine({"engine": "diffusers", "model": str(tiny_path), "dtype": "float32", "device": "cpu",
                            "base_weights": base})


def transposed_views(model) -> dict:
    """The model's parameters as other tensors' views, 2-D ones transposed twice (non-contiguous storage, as the
    trainer's (in, out) kernels are): what a sharing trainer hands over."""
    return {name: p.detach().t().contiguous().t() if p.ndim == 2 else p.detach().clone()
            for name, p in model.named_parameters()}


def test_an_engine_on_shared_weights_serves_them_without_a_copy(tiny_path):
    own, shared = engine(tiny_path, "own"), engine(tiny_path, "shared")
    with pytest.raises(RuntimeError, match="waits for its base weights"):
        shared.generate(["a red fox"], 2, SAMPLING, [1, 2])
    assert all(p.is_meta for p in shared.pipeline.transformer.parameters())  # nothing allocated for them
    tensors = transposed_views(own.pipeline.transformer)
    info = shared.share_base_weights(tensors)
    assert info["fingerprint"] == own.info()["fingerprint"] and info["base_weights"] == "shared"
    for name, p in shared.pipeline.transformer.named_parameters():
        assert p.data_ptr() == tensors[name].data_ptr() and not p.requires_grad, name
    a = own.generate(["a red fox"], 2, SAMPLING, [1, 2])
    b = shared.generate(["a red fox"], 2, SAMPLING, [1, 2])
    # the same float32 weights; only the GEMMs' operand layout differs (float32 rounding of the sums)
    assert np.allclose(a["log_probs"], b["log_probs"], rtol=0, atol=1e-5)
    assert np.abs(a["latents"] - b["latents"]).max() < 1e-4
    with pytest.raises(RuntimeError, match="cannot sleep"):
        shared.sleep()
    with pytest.raises(RuntimeError, match="keeps its own base weights"):
        own.share_base_weights(tensors)


def test_mismatched_weights_are_refused_and_nothing_changes(tiny_path):
    shared = engine(tiny_path, "shared")
    model = RolloutPipeline.from_pretrained(tiny_path, dtype="float32", device="cpu").transformer
    tensors = transposed_views(model)
    name = next(iter(tensors))
    for bad, needle in (({**tensors, name: tensors[name][..., :1]}, f"{name}: torch.float32"),
                        ({k: v for k, v in tensors.items() if k != name}, f"missing {name}"),
                        ({k: v.double() for k, v in tensors.items()}, "torch.float64")):
        with pytest.raises(ValueError, match=needle):
            shared.share_base_weights(bad)
        assert all(p.is_meta for p in shared.pipeline.transformer.parameters())
    with pytest.raises(ValueError, match="random_seed"):
        DiffusersEngine({"engine": "diffusers", "model": str(tiny_path), "base_weights": "shared", "random_seed": 1})


@pytest.mark.slow  # a whole Trainer with its in-process engine, one step
def test_the_trainer_shares_its_base_with_the_in_process_engine(tmp_path):
    """One copy: every engine parameter is a view into a JAX array of the model's base; the loop trains on it, and
    the rollout's log-probs match the trainer's recompute as with an engine of its own (float32)."""
    cfg = tiny_config(tmp_path, num_steps=1)
    cfg.rollout.layout, cfg.rollout.share_weights, cfg.eval.every = "in_process", True, 0
    trainer = Trainer(cfg)
    try:
        transformer = trainer.driver.rollout.servers[0].engine.pipeline.transformer
        arrays = [a for leaf in jax.tree.leaves(nnx.state(trainer.learner.model, nnx.Param))
                  for a in (leaf if isinstance(leaf, tuple) else (leaf,))]
        spans = [(a.unsafe_buffer_pointer(), a.unsafe_buffer_pointer() + a.nbytes) for a in arrays]
        base = [(n, p) for n, p in transformer.named_parameters() if "lora_" not in n]  # PEFT's layers are its own
        assert len(base) == len(dict(transformer.named_parameters())) - 2 * trainer.driver.rollout.last_ack[
            "bound_modules"]
        for name, p in base:
            assert any(lo <= p.data_ptr() < hi for lo, hi in spans), name
        metrics = trainer.train_one(0)
        assert metrics["skipped"] == 0 and np.max(metrics["logp_diff_max"]) < 1e-5
    finally:
        trainer.close()


@pytest.mark.parametrize("changes, needle", [
    ({"layout": "colocated"}, "needs rollout.layout='in_process' and rollout.engine='diffusers'"),
    ({"dtype": "bfloat16"}, "set rollout.dtype to model.param_dtype"),
    ({"sleep_while_training": True}, "cannot sleep"),
])
def test_the_config_refuses_what_cannot_share(tmp_path, changes, needle):
    cfg = tiny_config(tmp_path)
    cfg.rollout.update(layout="in_process", share_weights=True)
    config_lib.validate(cfg)
    cfg.rollout.update(**changes)
    with pytest.raises(config_lib.UserError, match=needle):
        config_lib.validate(cfg)
    cfg = tiny_config(tmp_path)
    cfg.rollout.update(layout="in_process", share_weights=True)
    with pytest.raises(config_lib.UserError, match="one device of the engine's kind"):
        config_lib.check_layout(cfg, "gpu", 1)
