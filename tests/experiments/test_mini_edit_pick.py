"""The mini edit proof's pick of the pretraining length (fast): snapshots saved during one pretraining run hold the
EMA weights of that step, and the pick rule, its refusals and the install of the chosen transformer."""
import json
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from experiments.mini_edit import pick
from experiments.mini_edit.pretrain import EditFeed
from experiments.mini_ocr import pretrain as base
from jaxflow.families.qwen_image.config import QwenImageConfig
from jaxflow.families.qwen_image.loading import save_transformer
from jaxflow.families.qwen_image_edit.transformer import QwenImageEditTransformer
from jaxflow.nn.config import ModelOptions
from tests.qwen_ref import TINY

TOKENS, N, L = 32, 6, 5  # 64 x 128 images at 16 pixels a token: a 4 x 8 grid; 6 pairs; 5 text tokens
WEIGHTS = "diffusion_pytorch_model.safetensors"


def toy_pipeline(folder: Path) -> Path:
    """A pipeline folder as far as pretraining reads it: a one-layer tiny edit transformer/, the scheduler's shift
    settings and a VAE config of 16 pixels a token."""
    model = QwenImageEditTransformer(QwenImageConfig(**dict(TINY, num_layers=1)),
                                     ModelOptions(dtype="float32", param_dtype="float32"), rngs=nnx.Rngs(0))
    save_transformer(model, folder / "transformer")
    (folder / "scheduler").mkdir()
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        dict(base_image_seq_len=256, max_image_seq_len=8192, base_shift=0.5, max_shift=0.9)))
    (folder / "vae").mkdir()
    (folder / "vae" / "config.json").write_text(json.dumps(dict(temperal_downsample=[False, True, True])))
    return folder


def toy_data(data: Path) -> Path:
    """What `python -m experiments.mini_edit.prepare encode` writes, random, at the toy pipeline's token count."""
    data.mkdir()
    rng = np.random.default_rng(0)
    np.savez(data / "latents.npz", targets=rng.normal(size=(N, TOKENS, 64)).astype(np.float32),
             sources=rng.normal(size=(N, TOKENS, 64)).astype(np.float32))
    mask = np.ones((N, L), bool)
    np.savez(data / "text.npz", embeds=rng.normal(size=(N, L, 64)).astype(np.float32), mask=mask,
             neg_embeds=rng.normal(size=(N, L, 64)).astype(np.float32), neg_mask=mask)
    return data


def weights(folder: Path) -> dict[str, np.ndarray]:
    return load_file(folder / WEIGHTS)


class StopAfter:
    """A stand-in for pretraining's `time` module whose clock passes the time cap once `steps` steps are done (the
    loop reads it once before its first step and once after each)."""

    def __init__(self, steps: int):
        self.reads = iter([0.0] * (steps) + [1e9] * 100)

    def perf_counter(self) -> float:
        return next(self.reads)


@pytest.mark.slow  # two compiles of the toy model
def test_snapshots_hold_the_ema_weights_of_their_step(tmp_path, monkeypatch):
    data = toy_data(tmp_path / "data")
    run = dict(steps=3, batch=2, lr=1e-2, dtype="float32", ema_decay=0.5, log_every=1, log=lambda _: None)
    full, cut = toy_pipeline(tmp_path / "full"), toy_pipeline(tmp_path / "cut")
    start = weights(full / "transformer")
    base.pretrain(full, EditFeed(data), **run, save_at={2, 3}, snapshots=tmp_path / "snapshots")
    assert sorted(p.name for p in (tmp_path / "snapshots").iterdir()) == ["2", "3"]
    # the same run (same schedule, seed and batches) stopped by its time cap after step 2 writes step 2's EMA
    monkeypatch.setattr(base, "time", StopAfter(2))
    base.pretrain(cut, EditFeed(data), **run, max_minutes=1)
    two, last = (weights(tmp_path / "snapshots" / s / "transformer") for s in ("2", "3"))
    assert two.keys() == last.keys() == start.keys()
    assert any(not np.array_equal(two[k], start[k]) for k in start)  # step 2 moved the weights (step 1's lr is 0)
    assert any(not np.array_equal(two[k], last[k]) for k in start)  # and step 3 moved them on
    for k, v in weights(cut / "transformer").items():
        np.testing.assert_array_equal(two[k], v, err_msg=k)
    for k, v in weights(full / "transformer").items():
        np.testing.assert_array_equal(last[k], v, err_msg=k)
    assert json.loads((tmp_path / "snapshots" / "3" / "transformer" / "config.json").read_text())["num_layers"] == 1


@pytest.mark.parametrize("argv, message", [
    (["--save-at", "2,5"], "steps in 1..--steps (4)"),  # past the run's last step
    (["--save-at", "2"], "needs --snapshots DIR"),
])
def test_pretrain_refuses_snapshot_steps_it_cannot_save(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        base.main(["--pipeline", str(tmp_path), "--data", str(tmp_path), "--steps", "4", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_pick_is_the_score_closest_to_the_target_ties_to_the_earlier_step():
    assert pick.closest({400: 0.01, 800: 0.3, 1200: 0.9, 2000: 0.99}, 0.5) == 800
    assert pick.closest({400: 0.01, 800: 0.3, 1200: 0.6, 2000: 0.99}, 0.5) == 1200
    assert pick.closest({1200: 0.75, 800: 0.25, 2000: 1.0}, 0.5) == 800  # a tie, given in any order
    assert pick.closest({600: 0.0, 300: 0.0}, 0.5) == 300
    assert pick.closest({900: 0.2}, 0.9) == 900


def snapshot(folder: Path, value: float) -> Path:
    (folder / "transformer").mkdir(parents=True)
    (folder / "transformer" / "config.json").write_text(json.dumps(dict(value=value)))
    return folder


def test_a_missing_snapshot_is_refused_with_one_line_before_any_scoring(tmp_path, capsys):
    good = snapshot(tmp_path / "snapshots" / "700", 0.7)
    assert pick.snapshot_steps([snapshot(tmp_path / "snapshots" / "1200", 1.2), good]) == {
        700: good, 1200: tmp_path / "snapshots" / "1200"}
    for bad in (tmp_path / "snapshots" / "900", snapshot(tmp_path / "snapshots" / "last", 0.0)):
        with pytest.raises(ValueError, match=f"snapshot {bad}: expected a folder named by its step"):
            pick.snapshot_steps([good, bad])
    with pytest.raises(SystemExit) as exit_:
        pick.main(["--pipeline", str(tmp_path / "pipeline"), "--snapshots", str(good), str(tmp_path / "snapshots/*"),
                   "--data", str(tmp_path / "test.jsonl"), "--json", str(tmp_path / "pick.json")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: snapshot ") and err.count("\n") == 1
    assert not (tmp_path / "pick.json").exists()


def test_the_chosen_transformer_replaces_the_pipelines(tmp_path):
    pipeline = tmp_path / "pipeline"
    snapshot(pipeline, 2.0)
    (pipeline / "vae").mkdir()
    (pipeline / "model_index.json").write_text("{}")
    chosen = snapshot(tmp_path / "snapshots" / "800", 0.8)
    with pick.with_transformer(pipeline, chosen / "transformer") as folder:
        assert sorted(p.name for p in folder.iterdir()) == ["model_index.json", "transformer", "vae"]
        assert json.loads((folder / "transformer" / "config.json").read_text()) == dict(value=0.8)
        assert (folder / "vae").resolve() == (pipeline / "vae").resolve()
    assert not folder.exists()
    pick.install(chosen / "transformer", pipeline)
    assert json.loads((pipeline / "transformer" / "config.json").read_text()) == dict(value=0.8)
    assert sorted(p.name for p in pipeline.iterdir()) == ["model_index.json", "transformer", "vae"]
    assert (chosen / "transformer" / "config.json").is_file()  # copied, the snapshot kept
