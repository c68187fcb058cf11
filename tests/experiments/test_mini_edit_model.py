"""The mini edit proof's pretraining feed and loss (fast), and `SMOKE=1 bash experiments/mini_edit/run.sh OUT`: every
step at toy size on the CPU (slow)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from experiments.mini_edit.pretrain import EditFeed
from experiments.mini_ocr.pretrain import make_step, optimizer
from jaxflow.families.qwen_image.config import QwenImageConfig
from jaxflow.families.qwen_image_edit.transformer import QwenImageEditTransformer
from jaxflow.nn.config import ModelOptions
from tests import HANG_S
from tests.qwen_ref import TINY

ROOT = Path(__file__).resolve().parents[2]
GRID, N, L = (2, 4), 6, 5  # a 2x4 token grid, 6 pairs, 5 text tokens


def write_encoded(data: Path) -> None:
    """What `python -m experiments.mini_edit.prepare encode` writes, random, at toy shapes."""
    rng = np.random.default_rng(0)
    tokens, channels, width = GRID[0] * GRID[1], TINY["in_channels"], TINY["joint_attention_dim"]
    np.savez(data / "latents.npz", targets=rng.normal(size=(N, tokens, channels)).astype(np.float32),
             sources=rng.normal(size=(N, tokens, channels)).astype(np.float32))
    mask = np.arange(L)[None] < rng.integers(2, L + 1, (N, 1))
    np.savez(data / "text.npz", embeds=rng.normal(size=(N, L, width)).astype(np.float32), mask=mask,
             neg_embeds=rng.normal(size=(N, L, width)).astype(np.float32), neg_mask=np.roll(mask, 1, 0))


@pytest.mark.slow
def test_the_edit_feed_conditions_the_loss_on_sources_and_each_rows_negative(tmp_path):
    write_encoded(tmp_path)
    feed = EditFeed(tmp_path)
    assert (feed.size, feed.tokens, feed.neg, feed.model_type) == (N, 8, None, QwenImageEditTransformer)
    rows = np.array([0, 2, 5, 5])
    batch = feed.batch(rows)
    assert batch["x0"].shape == (4, 8, 64) and batch["refs"].shape == (4, 1, 8, 64)
    assert batch["txt"].shape == batch["neg_txt"].shape == (4, L, 64) and batch["neg_mask"].shape == (4, L)
    np.testing.assert_array_equal(batch["refs"][:, 0], np.load(tmp_path / "latents.npz")["sources"][rows])

    model = QwenImageEditTransformer(QwenImageConfig(**dict(TINY, num_layers=1)), ModelOptions(dtype="float32", param_dtype="float32"),
                                     rngs=nnx.Rngs(0))
    # p_uncond 1: every row is conditioned on its own negative embeds, never on its instruction's
    init, step = make_step(model, optimizer(1e-3, 10), GRID, 0.5, 1.0, 0.9)
    key = jax.random.key(0)

    def loss(**changed):
        return float(step(init(), {**batch, **changed}, None, key)[1])

    base = loss()
    assert np.isfinite(base) and base > 0
    assert loss(txt=batch["txt"] + 1.0) == base  # dropped: the instruction is not seen
    assert loss(neg_txt=batch["neg_txt"] + 1.0) != base  # each row's negative is
    assert loss(refs=batch["refs"] + 1.0) != base  # and the source's latents are
    np.savez(tmp_path / "latents.npz", targets=np.zeros((N - 1, 8, 64)), sources=np.zeros((N - 1, 8, 64)))
    with pytest.raises(ValueError, match="re-run"):
        EditFeed(tmp_path)


STEPS = ["data", "vae", "encode", "pretrain", "pick", "eval_before", "rl", "rl_control", "eval_after", "eval_control",
         "result"]


@pytest.mark.slow
def test_the_smoke_script_runs_every_step_and_writes_the_result(tmp_path):
    env = {**os.environ, "SMOKE": "1", "JAX_PLATFORMS": "cpu", "VAE_STEPS": "10", "PICK_STEPS": "5,3",
           "EVAL_NUM": "4", "PICK_NUM": "2", "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", str(ROOT / "experiments/mini_edit/run.sh"), str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert [line.split()[0] for line in (tmp_path / "timings.txt").read_text().splitlines()] == STEPS
    result = json.loads((tmp_path / "mini_edit.json").read_text())
    for key in ("edit_ocr_before", "edit_ocr_after", "edit_ocr_rise", "edit_ocr_rise_se", "edit_ocr_control_after",
                "rl_steps", "rl_minutes"):
        assert key in result["figures"], key
    assert result["figures"]["rl_steps"] == 2
    # the pick scored both snapshots and installed the chosen one as the pipeline's transformer
    picked = json.loads((tmp_path / "pick.json").read_text())
    assert sorted(picked["scores"]) == ["3", "5"] and picked["n"] == 2
    assert result["figures"]["pretrain_steps"] == picked["step"] in (3, 5)
    assert result["pick"]["scores"] == picked["scores"]
    chosen = tmp_path / "snapshots" / str(picked["step"]) / "transformer" / "diffusion_pytorch_model.safetensors"
    assert chosen.read_bytes() == (tmp_path / "pipeline/transformer/diffusion_pytorch_model.safetensors").read_bytes()
    # edit_ocr scored every step (the reward pool scores a failed reward 0; a toy model's edits score below 0)
    assert all(r != 0 for r in result["reward_curve"] + result["control_reward_curve"]), result["reward_curve"]
    for run in ("rl", "rl_control"):
        assert (tmp_path / run / "lora_final" / "adapter_config.json").exists()
    assert json.loads((tmp_path / "eval" / "before.json").read_text())["n"] == 4
