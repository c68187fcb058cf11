"""The one batch schema (`jaxflow_bridge.contract.batch`): a trajectory crossing into a process is checked there, once,
with one clear error for a missing or wrong-shaped field; the learner's batch and the algorithms' fields are its
names; the vLLM-Omni codec carries the numpy buffers themselves; one rollout call validates once."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from jaxflow.trainer.train_batch import TrainBatch
from jaxflow_bridge.contract import batch as schema
from jaxflow_bridge.contract import trajectory
from jaxflow_bridge.contract.trajectory import TrajectoryBatch
from tests.helpers_vllm_omni import synthetic_batch


def test_missing_or_wrong_shaped_field_is_one_clear_error_at_the_crossing():
    arrays = synthetic_batch().to_dict()
    del arrays["latents"]
    with pytest.raises(ValueError, match=r"^rollout trajectory: the trajectory is missing latents \(\(B, W\+1, S, C\) "
                                         r"float32\)$"):
        TrajectoryBatch.from_dict(arrays)
    arrays = synthetic_batch().to_dict()
    arrays["log_probs"] = arrays["log_probs"][..., None]
    with pytest.raises(ValueError, match=r"log_probs expected 2 dims \(B, W\) float32, got shape \(3, 2, 1\)"):
        TrajectoryBatch.from_dict(arrays)
    with pytest.raises(ValueError, match="unknown trajectory field 'advantage'"):
        TrajectoryBatch.from_dict({**synthetic_batch().to_dict(), "advantage": np.zeros(3)})


def test_batches_are_the_schemas_fields():
    assert tuple(f.name for f in dataclasses.fields(TrajectoryBatch)) == schema.TRAJECTORY_FIELDS
    assert {f.name for f in dataclasses.fields(TrainBatch)} == set(schema.TRAIN_FIELDS)
    for component in _components():
        assert set(component.fields) <= set(schema.FIELDS), component.name


def _components():
    from jaxflow.algorithms import (
        base,
        flowgrpo,
        grpo_guard,
        nft,
        old_log_prob,
        rollout_correction,
        zero_advantage,
    )
    mods = (flowgrpo, grpo_guard, nft, old_log_prob, rollout_correction, zero_advantage)
    found = [v for m in mods for v in vars(m).values() if isinstance(v, base.Component)]
    assert found
    return found


def test_codec_round_trip_keeps_the_numpy_buffers():
    torch = pytest.importorskip("torch")
    from jaxflow_bridge.engines.vllm_omni import codec

    batch = dataclasses.replace(synthetic_batch(cfg=True), final_latents=np.ones((3, 45, 64), np.float32))
    fields = codec.pack_trajectories(batch)
    result = SimpleNamespace(trajectory_latents=fields["trajectory_latents"],
                             trajectory_log_probs=fields["trajectory_log_probs"],
                             custom_output=fields["custom_output"], error=None)
    out = codec.unpack_trajectories(result, "p", group_id=0)
    for name in schema.PAYLOAD_FIELDS + ("latents", "log_probs"):
        mine, got = getattr(batch, name), getattr(out, name)
        if mine is None:
            assert got is None, name
            continue
        assert got.dtype == mine.dtype and np.shares_memory(got, mine), name  # a view: no torch/numpy copies
    assert isinstance(fields["trajectory_latents"], torch.Tensor)  # what vLLM-Omni's transport takes


def test_one_validation_per_rollout_call(tiny_path, monkeypatch):
    from jaxflow.run.rollout_client import LocalTransport, RolloutGroup

    calls = []
    check = trajectory.validate_arrays
    monkeypatch.setattr(trajectory, "validate_arrays", lambda *a: calls.append(1) or check(*a))
    group = RolloutGroup({"engine": "diffusers", "model": str(tiny_path), "dtype": "float32", "device": "cpu"},
                         transport=LocalTransport())
    sampling = {"height": 16, "width": 24, "num_inference_steps": 3, "sde_window_size": 1, "sde_window_range": (0, 2),
                "text_tokens": (64, 40), "true_cfg_scale": 4.0}  # the step's one text length, as the driver sends it
    batch = group.generate(["a red fox", "a blue cat"], 2, sampling, np.arange(4), prompts_per_call=1)
    assert len(batch) == 4 and batch.prompts == ("a red fox",) * 2 + ("a blue cat",) * 2
    assert len(calls) == 2  # the two calls' trajectories, each once as it arrives; not the producer's, not the join
    group.close()


def test_shapes_resolve_the_fields_dims_at_a_steps_sizes():
    sizes = {"B": 2, "W": 3, "N": 6, "S": 4, "C": 5, "L": 7, "L'": 1, "D": 8, "R": 2}
    got = schema.shapes(("latents", "sigmas", "negative_prompt_embeds", "noise_level"), sizes,
                        {"negative_prompt_embeds": schema.F32})
    assert got == {"latents": ((2, 4, 4, 5), schema.F32), "sigmas": ((7,), schema.F32),
                   "negative_prompt_embeds": ((2, 1, 8), schema.F32), "noise_level": ((), schema.F32)}
    per_sample = schema.shapes(schema.TRAIN_FIELDS, sizes, per_sample=True)
    assert per_sample["sigmas"] == ((2, 7), schema.F32) and per_sample["noise_level"] == ((2,), schema.F32)
    assert per_sample["prompt_embeds"] == ((2, 7, 8), schema.BF16) and per_sample["step_index"][1] == schema.INT32
    assert per_sample["reference_latents"] == ((2, 2, 4, 5), schema.F32)  # R reference images on the S tokens
    with pytest.raises(ValueError, match=r"^final_latents: no size for its dim 'S'"):
        schema.shapes(("final_latents",), {"B": 2, "C": 5})


def test_memory_plan_shapes_are_a_validated_trajectorys():
    """The compile-time memory plan's batch (`memory.abstract_batch`, from the schema) is what the step gets from a
    rollout's trajectory crossing into the trainer, with the recompute pass."""
    from jaxflow.trainer import memory
    from jaxflow.trainer.step_config import TrainConfig
    from jaxflow.trainer.train_step import prepare_batch
    traj = TrajectoryBatch.from_dict(synthetic_batch().to_dict())
    got = prepare_batch(TrainBatch.of(traj, np.zeros(len(traj), np.float32), 0.7), TrainConfig(grid_hw=(5, 9), guidance=4.0))
    (b, window), (s, c) = traj.log_probs.shape, traj.latents.shape[2:]
    spec, old = memory.abstract_batch(batch=b, window=window, num_steps=len(traj.sigmas) - 1, seq=s, channels=c,
                                      text=traj.prompt_mask.shape[1], negative_text=traj.negative_prompt_mask.shape[1],
                                      width=traj.prompt_embeds.shape[2], embed_dtype=traj.prompt_embeds.dtype,
                                      guided=True, recompute=True)
    assert {k: (v.shape, v.dtype) for k, v in got.items()} == {k: (v.shape, v.dtype) for k, v in spec.items()}
    assert (old["log_probs"].shape, old["log_probs"].dtype) == (got["log_probs"].shape, got["log_probs"].dtype)
