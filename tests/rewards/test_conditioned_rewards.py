"""Conditioned rewards (an edit's source image and target text) through MultiReward, the reward pool, the shuffled
control and the driver's per-sample conditions; counted rewards' per-batch counts (a VLM judge's refused replies)
through the pool to the step's metrics (rewards/base.py)."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest

from jaxflow.run.data import PromptItem
from jaxflow.run.driver import Experience, edit_conditions, merge_rewards
from jaxflow.trainer.train_batch import TrainBatch
from jaxflow_bridge.rewards import MultiReward, RewardPool, build_reward
from jaxflow_bridge.rewards.shuffled import Shuffled
from tests import HANG_S


class _Conditioned:
    """score = 100 * image id + 10 * source id + int(target); records the sizes of the pieces it scored."""

    conditioned = True
    splittable = True

    def __init__(self):
        self.sizes = []

    def __call__(self, images, prompts, *, sources, targets):
        assert sources.shape == images.shape and len(targets) == len(prompts) == len(images)
        self.sizes.append(len(images))
        ids = images[:, 0, 0, 0].astype(np.float32)
        return 100 * ids + 10 * sources[:, 0, 0, 0] + np.asarray([int(t) for t in targets], np.float32)


def _plain(images, prompts):  # a two-argument reward: any keyword would raise TypeError
    return np.ones(len(images), np.float32)


def _edit_batch(n):
    """n images numbered 0..n-1; sample i's source numbered i // 2 (groups of 2) and target str(i % 3)."""
    images = np.zeros((n, 2, 2, 3), np.uint8)
    images[:, 0, 0, 0] = np.arange(n)
    sources = np.zeros_like(images)
    sources[:, 0, 0, 0] = np.arange(n) // 2
    targets = [str(i % 3) for i in range(n)]
    expected = 100 * np.arange(n) + 10 * (np.arange(n) // 2) + np.arange(n) % 3
    return images, [f"p{i}" for i in range(n)], sources, targets, expected.astype(np.float32)


def test_pool_passes_each_pieces_sources_and_targets_to_conditioned_rewards_only():
    fn = _Conditioned()
    reward = MultiReward({"edit": fn, "plain": _plain}, {"edit": 1.0, "plain": 1.0})
    images, prompts, sources, targets, expected = _edit_batch(10)
    with RewardPool(reward, max_workers=4) as pool:
        out = pool.submit(images, prompts, sources, targets).result(timeout=HANG_S)
    assert out["errors"] == 0 and sorted(fn.sizes) == [2, 2, 3, 3]  # scored in pieces, each with its own slice
    np.testing.assert_array_equal(out["edit"], expected)
    np.testing.assert_array_equal(out["plain"], np.ones(10, np.float32))
    np.testing.assert_array_equal(reward(images, prompts, sources, targets)["edit"], expected)


def test_conditioned_reward_without_sources_fails_by_name():
    reward = MultiReward({"edit": _Conditioned(), "plain": _plain}, {"edit": 1.0, "plain": 1.0})
    images, prompts, *_ = _edit_batch(4)
    with pytest.raises(ValueError, match="conditioned reward .* needs each sample's source image"):
        reward(images, prompts)
    with RewardPool(reward, max_workers=2) as pool:
        out = pool.submit(images, prompts).result(timeout=HANG_S)
    assert out["errors"] == 1 and not out["edit"].any() and out["plain"].all()  # scored 0 and counted


def test_shuffled_control_scores_each_image_with_its_own_source_and_target():
    """Only the scores are permuted: the inner reward sees every image with its own source and target, also when
    the pool scores it in pieces, and the permutation is the seed's (the same as an unsplit call's)."""
    images, prompts, sources, targets, expected = _edit_batch(12)
    control = Shuffled(_Conditioned(), seed=3)
    assert control.conditioned
    with RewardPool(MultiReward({"shuffled": control}, {"shuffled": 1.0}), max_workers=3) as pool:
        out = pool.submit(images, prompts, sources, targets).result(timeout=HANG_S)
    assert control.inner.sizes == [4, 4, 4] and out["errors"] == 0
    np.testing.assert_array_equal(np.sort(out["shuffled"]), expected)
    assert not np.array_equal(out["shuffled"], expected)
    unsplit = Shuffled(_Conditioned(), seed=3)(images, prompts, sources=sources, targets=targets)
    np.testing.assert_array_equal(out["shuffled"], unsplit)


def test_edit_ocr_shuffled_is_a_conditioned_control():
    reward = build_reward({"edit_ocr_shuffled": 1.0}, edit_ocr_shuffled={"seed": 1, "num_threads": 1})
    assert reward.rewards["edit_ocr_shuffled"].conditioned


def test_driver_conditions_repeat_each_groups_reference_and_target():
    refs = [np.full((1, 2, 3, 3), v, np.uint8) for v in (5, 9)]
    items = [PromptItem("edit a", "A", "/a.png"), PromptItem("edit b", None, "/b.png")]
    sources, targets = edit_conditions(items, refs, 3)
    assert sources.shape == (6, 2, 3, 3) and sources.dtype == np.uint8
    np.testing.assert_array_equal(sources[:, 0, 0, 0], [5, 5, 5, 9, 9, 9])
    assert targets == ["A", "A", "A", None, None, None]
    one, _ = edit_conditions(items[:1], refs[:1], 4)
    assert one.shape == (4, 2, 3, 3) and np.shares_memory(one, refs[0])  # one group: a view, no copy
    assert edit_conditions(items, None, 3) == (None, None)


class _Counted:
    """A counted reward: refuses (scores 0, counts) the samples whose image id is odd."""

    def scored(self, images, prompts):
        odd = images[:, 0, 0, 0] % 2 == 1
        return np.where(odd, 0.0, 1.0).astype(np.float32), {"refused": int(odd.sum())}

    def __call__(self, images, prompts):
        return self.scored(images, prompts)[0]


def test_refusals_reach_the_steps_metrics():
    """A counted reward's per-batch counts come back in the pool's result and are summed over a step's chunks into
    reward/<name>/<count>."""
    reward = MultiReward({"judge": _Counted(), "plain": _plain}, {"judge": 1.0, "plain": 1.0})
    images, prompts, *_ = _edit_batch(7)  # ids 0..6: 3 odd
    with RewardPool(reward, max_workers=2) as pool:
        outs = [pool.submit(images[a:b], prompts[a:b]).result(timeout=HANG_S) for a, b in ((0, 4), (4, 7))]
    assert [o["counts"] for o in outs] == [{"judge": {"refused": 2}}, {"judge": {"refused": 1}}]
    futures = {}
    for c, out in enumerate(outs):
        futures[c] = Future()
        futures[c].set_result(out)
    merged = merge_rewards(futures)
    metrics = Experience(TrainBatch(advantages=np.zeros(7)), merged, 0.0, 0, 1).metrics(1, 1.0)
    assert metrics["reward/judge/refused"] == 3 and "reward/plain/refused" not in metrics
    assert "reward/counts" not in metrics


def test_vlm_edit_judge_counts_its_refusals_per_batch(fake_server):
    fake_server.reply = "no idea"
    url = f"http://127.0.0.1:{fake_server.server_address[1]}"
    reward = build_reward({"vlm_edit_judge": 1.0}, vlm_edit_judge={"base_url": url, "model": "fake-vl"})
    images, prompts, sources, targets, _ = _edit_batch(3)
    with RewardPool(reward, max_workers=2) as pool:
        out = pool.submit(images, prompts, sources, targets).result(timeout=HANG_S)
    assert out["counts"] == {"vlm_edit_judge": {"refused": 3}} and not out["vlm_edit_judge"].any()
    assert reward.rewards["vlm_edit_judge"].refused == 3
    fake_server.reply = "7"
    with RewardPool(reward, max_workers=2) as pool:
        out = pool.submit(images, prompts, sources, targets).result(timeout=HANG_S)
    assert out["counts"] == {"vlm_edit_judge": {"refused": 0}}
    np.testing.assert_allclose(out["vlm_edit_judge"], 0.7)


@pytest.mark.slow
def test_a_conditioned_reward_in_a_ray_actor_gets_its_sources(ray_session):
    """reward.options.edit_ocr.actor: the actor's reward is conditioned too and scores as in the trainer's process."""
    from jaxflow.run.data import load_prompts, load_reference
    from tests.helpers import ROOT

    items = load_prompts(ROOT / "data" / "edit_signs" / "test.jsonl")[:2]
    sources = np.concatenate([load_reference(it.image, 64, 128) for it in items])
    images, prompts, targets = sources[::-1].copy(), [it.prompt for it in items], [it.target for it in items]
    local = build_reward({"edit_ocr": 1.0}, edit_ocr={"num_threads": 1})(images, prompts, sources, targets)
    remote = build_reward({"edit_ocr": 1.0}, edit_ocr={"num_threads": 1, "actor": {"num_cpus": 0}})
    assert remote.rewards["edit_ocr"].conditioned
    with RewardPool(remote, max_workers=2) as pool:
        out = pool.submit(images, prompts, sources, targets).result(timeout=HANG_S)
    assert out["errors"] == 0
    np.testing.assert_allclose(out["edit_ocr"], local["edit_ocr"], rtol=1e-6)
