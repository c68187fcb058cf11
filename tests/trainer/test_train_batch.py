"""The learner's `TrainBatch`: made once by the driver from the rollout's TrajectoryBatch, its rows laid out as the
mini-batches need, refused when a field lacks the batch's rows, and prepared for the step exactly as the rollout's
arrays are."""
import types

import ml_dtypes
import numpy as np
import pytest

from jaxflow.run.driver import train_batch
from jaxflow.trainer.minibatches import group_order, zero_advantage_order
from jaxflow.trainer.step_config import TrainConfig
from jaxflow.trainer.train_batch import TrainBatch
from jaxflow_bridge.contract.batch import SHARED_FIELDS
from jaxflow.trainer.train_step import prepare_batch
from jaxflow_bridge.contract.trajectory import TrajectoryBatch

B, W, N, S, C, L, NEG, D = 8, 2, 6, 4, 8, 5, 3, 16
BF16 = np.dtype(ml_dtypes.bfloat16)


def trajectory(final: bool = False) -> TrajectoryBatch:
    """4 prompt groups of 2 (rows interleaved), every row's arrays distinct, true CFG, 32x32 images (S = 4)."""
    r = np.random.default_rng(0)
    starts = r.integers(0, N - 1 - W, size=B)
    return TrajectoryBatch(
        images=r.integers(0, 255, (B, 32, 32, 3), dtype=np.uint8),
        latents=r.normal(size=(B, W + 1, S, C)).astype(np.float32), log_probs=r.normal(size=(B, W)).astype(np.float32),
        sigmas=np.linspace(1, 0, N + 1, dtype=np.float32), step_index=(starts[:, None] + np.arange(W)).astype(np.int32),
        prompt_embeds=r.normal(size=(B, L, D)).astype(BF16), prompt_mask=r.random((B, L)) < 0.7,
        negative_prompt_embeds=r.normal(size=(B, NEG, D)).astype(BF16), negative_prompt_mask=r.random((B, NEG)) < 0.7,
        prompts=[f"p{i}" for i in range(B)], group_ids=np.tile(np.arange(4), 2).astype(np.int64),
        seeds=np.arange(B, dtype=np.int64), policy_versions=np.zeros(B, np.int64),
        final_latents=r.normal(size=(B, S, C)).astype(np.float32) if final else None)


ADV = np.array([1.0, 0.0, -1.0, 0.0, 0.5, 0.0, 2.0, 0.0], np.float32)  # groups 1 and 3: equal rewards


def config(**train):
    train = {"num_mini_batches": 2, "num_micro_batches": 2, "drop_zero_advantage": True, **train}
    return types.SimpleNamespace(seed=3, sample=types.SimpleNamespace(noise_level=0.7),
                                 train=types.SimpleNamespace(**train))


def test_the_driver_lays_out_one_batch_whose_per_sample_fields_move_together():
    traj = trajectory(final=True)
    got = train_batch(traj, ADV, traj.group_ids, config(), step=5, num_micro_batches=2)
    order = group_order(traj.group_ids, 2, 3, 5)
    order = order[zero_advantage_order(ADV[order], 2, 2)]
    assert sorted(order) == list(range(B)) and not np.array_equal(order, np.arange(B))
    assert isinstance(got, TrainBatch) and len(got) == B
    assert set(got.arrays()) == {"advantages", "latents", "log_probs", "step_index", "sigmas", "noise_level",
                                 "prompt_embeds", "prompt_mask", "negative_prompt_embeds", "negative_prompt_mask",
                                 "final_latents"}  # images, prompts, ids, seeds and versions stay with the driver
    for name, value in got.arrays().items():
        if name in SHARED_FIELDS:
            continue
        assert len(value) == B, name
        want = ADV if name == "advantages" else getattr(traj, name)
        np.testing.assert_array_equal(value, want[order], err_msg=name)
        assert value.dtype == want.dtype, name
    assert got.sigmas is traj.sigmas and got.noise_level.dtype == np.float32 and got.noise_level == np.float32(0.7)
    plain = train_batch(traj, ADV, traj.group_ids, config(num_mini_batches=1, drop_zero_advantage=False), step=5,
                        num_micro_batches=2)
    np.testing.assert_array_equal(plain.latents, traj.latents)  # one mini-batch, nothing dropped: rows as sampled


@pytest.mark.parametrize("name, value", [("latents", np.zeros((B - 1, W + 1, S, C), np.float32)),
                                         ("prompt_mask", np.zeros((), bool)),
                                         ("sigmas", np.zeros((B - 2, N + 1), np.float32)),
                                         ("noise_level", np.zeros(B + 1, np.float32))])
def test_a_field_without_the_batch_s_rows_is_refused_by_name(name, value):
    with pytest.raises(ValueError) as err:
        TrainBatch(advantages=ADV, **{name: value})
    message = str(err.value)
    assert message.startswith(f"{name}: expected a leading sample axis of B={B}") and "\n" not in message
    assert str(value.shape) in message
    with pytest.raises(TypeError, match="images"):
        TrainBatch(advantages=ADV, images=np.zeros((B, 32, 32, 3), np.uint8))


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_the_step_s_arrays_are_the_rollout_s_bit_for_bit(guidance):
    """What the step consumes from a TrainBatch equals the rollout's arrays taken as they were: each field the step
    reads, sigmas and noise_level broadcast to every row, step_index int32, noise_level and sigmas float32; the rows a
    process shares (`per_sample`) prepare the same."""
    traj = trajectory()
    tc = TrainConfig(grid_hw=(2, 2), guidance=guidance, num_micro_batches=2)
    got = prepare_batch(TrainBatch.of(traj, ADV, 0.7), tc)
    raw = {**traj.to_dict(), "advantages": ADV}
    want = {k: raw[k] for k in tc.batch_fields if k not in SHARED_FIELDS}
    want.update(sigmas=np.tile(traj.sigmas, (B, 1)), noise_level=np.full(B, 0.7, np.float32))
    assert {k: (v.shape, v.dtype) for k, v in got.items()} == {k: (v.shape, v.dtype) for k, v in want.items()}
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    shared = prepare_batch(TrainBatch(**TrainBatch.of(traj, ADV, 0.7).per_sample()), tc)
    for k in want:
        np.testing.assert_array_equal(shared[k], want[k], err_msg=k)
        assert shared[k].dtype == want[k].dtype, k
