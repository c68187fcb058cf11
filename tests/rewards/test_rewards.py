"""Rewards: text scoring, RapidOCR, VLM client (against a loopback fake server), JPEG, pooling."""

from __future__ import annotations

import base64
import io
import socket
import threading
import time

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from jaxflow_bridge.rewards import (MultiReward, OcrReward, RewardPool, VlmOcrReward, build_reward, edit_score,
                                    extract_target, jpeg_compressibility, jpeg_incompressibility)
from tests import HANG_S


def render(text: str, size=(512, 128), font_size=56) -> np.ndarray:
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((20, 30), text, fill="black",
                               font=ImageFont.load_default(size=font_size))
    return np.asarray(image)


# --- text scoring -------------------------------------------------------------------------------

def test_extract_target():
    assert extract_target('a sign that reads "Fresh Bread" and "x"') == "Fresh Bread"
    assert extract_target("no quotes here") is None
    assert extract_target('empty "" quotes') is None
    assert extract_target('unclosed "quote') is None


@pytest.mark.parametrize("recognized,target,expected", [
    ("HELLO WORLD", "hello world", 1.0),              # case and spaces ignored
    ("xx helloworld yy", "Hello World", 1.0),         # substring
    ("helo world", "hello world", 0.9),               # one deletion over 10 chars
    ("hello\nwrld!", "hello world", 1.0 - 2 / 10),    # newline stripped; 1 del + 1 ins
    ("", "abc", 0.0),                                 # nothing recognised
    ("a completely different long text", "abc", 0.0),  # distance capped at len(target)
])
def test_edit_score(recognized, target, expected):
    assert edit_score(recognized, target) == pytest.approx(expected)


def test_edit_score_rejects_blank_target():
    with pytest.raises(ValueError):
        edit_score("abc", "   ")


# --- RapidOCR ------------------------------------------------------------------------------------

def test_ocr_reward_on_rendered_text():
    hello = render("HELLO WORLD")
    images = np.stack([hello, np.full((128, 512, 3), 255, np.uint8), hello])
    prompts = ['a sign that reads "hello world"'] * 2 + ['a sign that reads "Hello Word"']
    scores = OcrReward(num_threads=2)(images, prompts)
    assert scores.dtype == np.float32 and scores.shape == (3,)
    assert scores[0] >= 0.9
    assert scores[1] < 0.2
    assert scores[2] == pytest.approx(1 - 1 / 9)  # "helloworld" vs "helloword": one deletion


def test_ocr_reward_workers_score_in_parallel_with_their_own_engines():
    """The reward pool's threads each get an engine (no shared per-call state), and score as one thread does."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from jaxflow_bridge.rewards import ocr

    images = np.stack([render(w) for w in ("HELLO", "WORLD", "RIVER", "STONE")])
    prompts = [f'a sign that reads "{w}"' for w in ("hello", "world", "river", "stone")]
    reward = OcrReward(num_threads=1)
    serial = reward(images, prompts)
    both = threading.Barrier(2)  # each task waits for the other: the two run on the two threads at once

    def score(i):
        both.wait(timeout=HANG_S)
        return reward(images[i:i + 2], prompts[i:i + 2]), id(ocr.thread_engine(1))

    with ThreadPoolExecutor(2) as pool:
        (a, engine_a), (b, engine_b) = pool.map(score, (0, 2))
    np.testing.assert_array_equal(np.concatenate([a, b]), serial)
    assert len({engine_a, engine_b, id(ocr.thread_engine(1))}) == 3  # one per thread, none shared


def test_ocr_reward_requires_target():
    with pytest.raises(ValueError, match="no quoted target"):
        OcrReward()(np.zeros((1, 32, 32, 3), np.uint8), ["no target"])


# --- VLM OCR client ------------------------------------------------------------------------------

def _client(srv, **kw) -> VlmOcrReward:
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    return VlmOcrReward(url, "fake-vl", backoff=0.01, timeout=5.0, **kw)


def test_vlm_ocr_scores_and_request_format(fake_server):
    images = np.stack([render("x", (64, 32), 12)] * 2)
    prompts = ['a sign that reads "Hello World"', 'a mug with "hello word"']
    scores = _client(fake_server, temperature=0.1, max_tokens=64)(images, prompts)
    np.testing.assert_allclose(scores, [1.0, 1.0 - 1 / 9], rtol=1e-6)
    body = fake_server.posts[0]
    assert body["model"] == "fake-vl" and body["temperature"] == 0.1 and body["max_tokens"] == 64
    system, user = body["messages"]
    assert system == {"role": "system", "content": "You are a helpful assistant."}
    image_part, text_part = user["content"]
    assert text_part["text"].startswith("Please output only the text content")
    url = image_part["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    decoded = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))
    np.testing.assert_array_equal(decoded, images[0])


@pytest.mark.parametrize("task, reply, want, refused", [
    ("geneval", "Yes.", 1.0, 0), ("geneval", "no, it shows two cats", 0.0, 0), ("geneval", "Answer: yes", 1.0, 0),
    ("geneval", "yesterday", 0.0, 2), ("quality", "7/10", 0.7, 0), ("quality", "On a scale of 1 to 10: 8", 0.8, 0),
    ("quality", "I'd say 6 out of 10 for the 2 cats", 0.6, 0), ("quality", "-3", 0.0, 2),
    ("quality", "Rating: 12", 0.0, 2), ("quality", "Answer: yes", 0.0, 2), ("quality", "unsure", 0.0, 2)])
def test_vlm_judge_asks_about_each_prompt_and_parses_the_verdict(fake_server, task, reply, want, refused):
    """The reply contract of jaxflow_bridge/rewards/vlm/vlm_judge.py: a reply outside it scores 0 and is counted."""
    from jaxflow_bridge.rewards.vlm.vlm_judge import VlmJudge

    fake_server.reply = reply
    url = f"http://127.0.0.1:{fake_server.server_address[1]}"
    judge = build_reward({"vlm_judge": 1.0}, vlm_judge={"base_url": url, "model": "fake-vl", "task": task})
    images = np.zeros((2, 16, 16, 3), np.uint8)
    scores = judge(images, ["three red apples", "a dog left of a cat"])["vlm_judge"]
    np.testing.assert_allclose(scores, [want, want])
    assert judge.rewards["vlm_judge"].refused == refused
    asked = sorted(body["messages"][1]["content"][1]["text"] for body in fake_server.posts)
    assert "three red apples" in asked[1] and "a dog left of a cat" in asked[0]
    assert all(body["temperature"] == 0.0 for body in fake_server.posts)
    with pytest.raises(ValueError, match="must contain {prompt}"):
        VlmJudge(url, "fake-vl", template="Is it good?", answer="yes_no")
    with pytest.raises(ValueError, match="vlm_judge task 'counting'"):
        VlmJudge(url, "fake-vl", task="counting")


def test_vlm_ocr_retries_failed_attempt(fake_server):
    fake_server.fail_first = 1
    scores = _client(fake_server)(render("x", (64, 32), 12)[None], ['"hello world"'])
    assert scores[0] == 1.0
    assert len(fake_server.posts) == 2


def test_vlm_ocr_gives_up_on_client_error(fake_server):
    fake_server.fail_first, fake_server.fail_code = 10, 400
    with pytest.raises(RuntimeError, match="after 1 attempt"):
        _client(fake_server)(render("x", (64, 32), 12)[None], ['"hello world"'])
    assert len(fake_server.posts) == 1


def test_vlm_ocr_health_check_names_url():
    with socket.socket() as sock:  # reserve a free port, then close it: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(RuntimeError, match=f"{url}/v1/models"):
        VlmOcrReward(url + "/v1/", "m", timeout=2.0)


def test_vlm_ocr_health_check_unknown_model(fake_server):
    url = f"http://127.0.0.1:{fake_server.server_address[1]}"
    with pytest.raises(RuntimeError, match="fake-vl"):
        VlmOcrReward(url, "other-model")


# --- JPEG ----------------------------------------------------------------------------------------

def test_jpeg_signs():
    rng = np.random.default_rng(0)
    images = np.stack([np.full((64, 64, 3), 128, np.uint8),
                       rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)])
    comp = jpeg_compressibility(images, ["", ""])
    incomp = jpeg_incompressibility(images, ["", ""])
    assert comp.dtype == np.float32 and comp[0] > comp[1] and np.all(comp < 0)
    assert incomp[1] > incomp[0] > 0
    np.testing.assert_allclose(comp, -incomp / 500, rtol=1e-6)


# --- combination and pool ------------------------------------------------------------------------

def test_build_reward_weights_and_avg():
    images = np.stack([np.full((32, 32, 3), 7, np.uint8), np.full((32, 32, 3), 200, np.uint8)])
    reward = build_reward({"jpeg_compressibility": 2.0, "jpeg_incompressibility": 0.5})
    out = reward(images, ["a", "b"])
    assert set(out) == {"jpeg_compressibility", "jpeg_incompressibility", "avg"}
    expected = 2.0 * out["jpeg_compressibility"] + 0.5 * out["jpeg_incompressibility"]
    np.testing.assert_allclose(out["avg"], expected, rtol=1e-6)
    assert out["avg"].dtype == np.float32


def test_build_reward_unknown_name():
    with pytest.raises(ValueError, match="known.*jpeg_compressibility.*ocr"):
        build_reward({"aesthetics": 1.0})
    with pytest.raises(ValueError, match="unknown"):
        build_reward({"ocr": 1.0}, ocrr={"num_threads": 1})


def test_build_reward_passes_options():
    reward = build_reward({"ocr": 1.0}, ocr={"min_confidence": 0.7},
                          vlm_ocr={"base_url": "http://unused", "model": "m"})
    assert reward.rewards["ocr"].min_confidence == 0.7 and reward.names == ["ocr"]


def test_reward_pool_isolates_failures():
    def broken(images, prompts):
        raise RuntimeError("boom")

    def ones(images, prompts):
        return np.ones(len(images), np.float32)

    reward = MultiReward({"broken": broken, "ones": ones}, {"broken": 1.0, "ones": 3.0})
    images = np.zeros((4, 8, 8, 3), np.uint8)
    with RewardPool(reward, max_workers=2) as pool:
        futures = [pool.submit(images, ["p"] * 4) for _ in range(3)]
        results = [f.result(timeout=HANG_S) for f in futures]
    for out in results:
        assert out["errors"] == 1
        np.testing.assert_array_equal(out["broken"], np.zeros(4, np.float32))
        np.testing.assert_array_equal(out["ones"], np.ones(4, np.float32))
        np.testing.assert_array_equal(out["avg"], np.full(4, 3.0, np.float32))


def test_reward_pool_counts_bad_shapes():
    reward = MultiReward({"short": lambda im, p: np.ones(1)}, {"short": 1.0})
    with RewardPool(reward) as pool:
        out = pool.submit(np.zeros((2, 8, 8, 3), np.uint8), ["a", "b"]).result(timeout=HANG_S)
    assert out["errors"] == 1 and out["short"].shape == (2,)


class _PerSample:
    """A splittable reward (score = the image's first pixel) that records its calls; `barrier` makes each call wait
    until that many calls run at once (it breaks, failing the call, if they do not)."""

    splittable = True

    def __init__(self, barrier: threading.Barrier | None = None, fail_at: int | None = None):
        self.sizes, self.barrier, self.fail_at = [], barrier, fail_at

    def __call__(self, images, prompts):
        self.sizes.append(len(images))
        if self.barrier is not None:
            self.barrier.wait(timeout=20)
        if self.fail_at is not None and self.fail_at in images[:, 0, 0, 0]:
            raise RuntimeError("boom")
        return images[:, 0, 0, 0].astype(np.float32)


def _numbered(n):
    images = np.zeros((n, 2, 2, 3), np.uint8)
    images[:, 0, 0, 0] = np.arange(n)
    return images, [f"p{i}" for i in range(n)]


def test_reward_pool_scores_a_batch_in_pieces_at_once():
    fn = _PerSample(barrier=threading.Barrier(4))  # the 4 pieces must run at the same time, or the barrier breaks
    whole = []
    reward = MultiReward({"px": fn, "whole": lambda im, p: whole.append(len(im)) or np.ones(len(im), np.float32)},
                         {"px": 1.0, "whole": 2.0})
    images, prompts = _numbered(10)
    with RewardPool(reward, max_workers=4) as pool:
        out = pool.submit(images, prompts).result(timeout=HANG_S)
    assert out["errors"] == 0 and sorted(fn.sizes) == [2, 2, 3, 3] and whole == [10]
    np.testing.assert_array_equal(out["px"], np.arange(10, dtype=np.float32))  # the pieces in batch order
    np.testing.assert_array_equal(out["avg"], np.arange(10, dtype=np.float32) + 2.0)


def test_reward_pool_failing_piece_scores_the_reward_zero():
    reward = MultiReward({"px": _PerSample(fail_at=7)}, {"px": 1.0})
    images, prompts = _numbered(12)
    with RewardPool(reward, max_workers=3) as pool:
        out = pool.submit(images, prompts).result(timeout=HANG_S)
        empty = pool.submit(images[:0], []).result(timeout=HANG_S)
    assert out["errors"] == 1
    np.testing.assert_array_equal(out["px"], np.zeros(12, np.float32))
    assert empty["errors"] == 0 and empty["px"].shape == (0,)


def test_shuffled_control_permutes_across_the_whole_batch_when_split():
    from jaxflow_bridge.rewards.shuffled import Shuffled

    inner = _PerSample()
    reward = MultiReward({"shuffled": Shuffled(inner, seed=0)}, {"shuffled": 1.0})
    images, prompts = _numbered(48)
    with RewardPool(reward, max_workers=8) as pool:
        out = pool.submit(images, prompts).result(timeout=HANG_S)
    assert inner.sizes == [6] * 8  # scored in pieces
    scores = out["shuffled"].astype(int)
    assert sorted(scores) == list(range(48))
    assert any(s // 6 != i // 6 for i, s in enumerate(scores))  # scores moved between pieces
    np.testing.assert_array_equal(out["shuffled"], Shuffled(_PerSample(), seed=0)(images, prompts))  # same draw


def test_reward_pool_reports_each_rewards_scoring_seconds():
    """"seconds" holds each reward's worker seconds for the batch (a split reward's pieces summed, though they ran at
    once); the driver sums them over a step's chunks into time/reward_busy/<name>."""
    from concurrent.futures import Future

    from jaxflow.run.driver import Experience, merge_rewards
    from jaxflow.trainer.train_batch import TrainBatch

    def slow(images, prompts):
        time.sleep(0.05)
        return np.ones(len(images), np.float32)

    piecewise = _PerSample(barrier=threading.Barrier(4))
    reward = MultiReward({"px": piecewise, "slow": slow}, {"px": 1.0, "slow": 1.0})
    images, prompts = _numbered(8)
    with RewardPool(reward, max_workers=4) as pool:
        outs = [pool.submit(images, prompts).result(timeout=HANG_S) for _ in range(2)]
    for out in outs:
        assert set(out["seconds"]) == {"px", "slow"}
        assert 0.05 <= out["seconds"]["slow"] < 5 and 0 <= out["seconds"]["px"] < 5
    futures = {}
    for c, out in enumerate(outs):
        futures[c] = Future()
        futures[c].set_result(out)
    merged = merge_rewards(futures)
    assert merged["slow"].shape == (16,) and merged["seconds"]["slow"] == outs[0]["seconds"]["slow"] + \
        outs[1]["seconds"]["slow"]
    metrics = Experience(TrainBatch(advantages=np.zeros(16)), merged, 0.0, 0, 1).metrics(720, 2.0)
    assert metrics["time/reward_busy/slow"] == merged["seconds"]["slow"] >= 0.1
    assert "reward/seconds" not in metrics and metrics["reward/slow"] == 1.0
