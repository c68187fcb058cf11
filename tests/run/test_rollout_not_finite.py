"""A rollout of the policy before any update that returns non-finite values the loss reads stops the run at its step
(`divergence.RolloutNotFinite`): one line naming the engine and the fields, nothing of that step written, exit 1; a
later policy's rollout is left to the learner (its non-finite loss skips the update: `divergence.SkipStreak`).
The real Trainer loop and Driver, over a stand-in rollout engine and a stand-in learner that writes what a learner
writes (a checkpoint folder per save, lora_final at the export)."""
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from jaxflow import train
from jaxflow.config import validation
from jaxflow.trainer.divergence import RolloutNotFinite, rollout_not_finite
from jaxflow_bridge.contract.batch import nonfinite_rows
from jaxflow_bridge.contract.trajectory import TrajectoryBatch
from tests.helpers import cli_run_raising, tiny_config

W, N, S, C, L, D = 2, 4, 4, 8, 5, 16


def trajectory(rows: int, version: int, seed: int) -> TrajectoryBatch:
    """`rows` finite samples of policy `version`: 32x32 images (S = 4), embeds text, no CFG."""
    r = np.random.default_rng(seed)
    return TrajectoryBatch(
        images=r.integers(0, 255, (rows, 32, 32, 3), dtype=np.uint8),
        latents=r.normal(size=(rows, W + 1, S, C)).astype(np.float32),
        log_probs=r.normal(size=(rows, W)).astype(np.float32), sigmas=np.linspace(1, 0, N + 1, dtype=np.float32),
        step_index=np.tile(np.arange(W, dtype=np.int32), (rows, 1)),
        prompt_embeds=r.normal(size=(rows, L, D)).astype(np.float32), prompt_mask=np.ones((rows, L), bool),
        prompts=[f"p{i}" for i in range(rows)], group_ids=np.arange(rows, dtype=np.int64),
        seeds=np.arange(rows, dtype=np.int64), policy_versions=np.full(rows, version, np.int64))


class Rollout:
    """A stand-in engine's group: each call returns finite samples, but at step `broken` (as the metrics count)
    `spoil` makes them non-finite; it serves the version the driver last synced."""

    def __init__(self, broken: int | None, spoil):
        self.broken, self.spoil, self.version, self.calls = broken, spoil, None, 0

    def generate(self, prompts, n, sampling, seeds, per_call, on_chunk=None, references=None):
        self.calls += 1
        batch = trajectory(len(prompts) * n, self.version, self.calls)
        if self.calls == self.broken:
            self.spoil(batch)
        for c in range(0, len(prompts), per_call):  # the driver scores each chunk as it arrives
            rows = slice(c * n, (c + per_call) * n)
            on_chunk(c // per_call, SimpleNamespace(images=batch.images[rows], prompts=batch.prompts[rows]))
        return batch

    def release_adapter(self):
        pass

    def close(self):
        pass


def _stand_ins(monkeypatch, rollout: Rollout, trained: list):
    class Learner:
        sampling = exported = "lora"
        compile_times = []

        def __init__(self, cfg, folder, plan):
            self.cfg, self.plan, self.model, self.state = cfg, plan, object(), None

        def check_memory(self):
            return None

        def begin(self, resume):
            return None

        def start_upgrade(self):
            pass

        def whole_lora(self, which):
            return {}

        def micro_batch_size(self):
            return 1

        def train(self, batch, version, behavior):
            trained.append(version)
            return {"loss": 0.0, "skipped": 0}

        def save(self, step, meta):
            (Path(self.cfg.run_dir) / "checkpoints" / str(step)).mkdir(parents=True)

        def export_lora(self, directory):
            directory.mkdir()

    def launch(self):
        self.rollout = rollout

    monkeypatch.setattr(train, "Learner", Learner)
    monkeypatch.setattr(train.Driver, "launch_rollout", launch)
    monkeypatch.setattr(train.Driver, "join_rollout", lambda self, model, processes: None)
    monkeypatch.setattr(train.Driver, "serve", lambda self, lora, version: setattr(rollout, "version", version) or 0)
    monkeypatch.setattr(train.Driver, "sync_summary", lambda self, seconds: "")


def _run(tmp_path, monkeypatch, trained: list, broken=None, spoil=None):
    """A 3-step run (a checkpoint every step) over the stand-ins, the versions trained put in `trained`; the run's
    folder."""
    run_dir = tmp_path / "run"
    _stand_ins(monkeypatch, Rollout(broken, spoil), trained)
    cfg = tiny_config(run_dir, num_steps=3)
    cfg.eval.every, cfg.checkpoint.every, cfg.rollout.layout = 0, 1, "in_process"
    trainer = train.Trainer(validation.validate(cfg))
    try:
        trainer.run()
    finally:
        trainer.close()
    return run_dir


def _written(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("*")) + \
        (["lora_final"] if (run_dir / "lora_final").exists() else [])


def test_finite_rollouts_train_every_step(tmp_path, monkeypatch):
    trained = []
    run_dir = _run(tmp_path, monkeypatch, trained)
    assert trained == [0, 1, 2] and _written(run_dir) == ["1", "2", "3", "lora_final"]


def test_nan_log_probs_at_the_first_step_stop_the_run_before_any_update(tmp_path, monkeypatch):
    """vLLM-Omni with FP8 as seen on an H200: every row's log-probs NaN from the first rollout on."""
    def spoil(batch):
        batch.log_probs[:] = np.nan

    trained = []
    with pytest.raises(RolloutNotFinite) as err:
        _run(tmp_path, monkeypatch, trained, broken=1, spoil=spoil)
    run_dir = tmp_path / "run"
    message = str(err.value)
    assert message.startswith("step 1's rollout returned non-finite values (log_probs: 16 of 16 rows) from the "
                              "diffusers engine (rollout.quantization=none, LoRA served as ")
    assert "serving the policy before any update: the engine's output is broken, not the policy; no update ran on it" \
        in message and "\n" not in message
    assert message.endswith("check the engine's log")
    assert _written(run_dir) == [] and trained == []


def test_a_later_policy_s_non_finite_rollout_is_left_to_the_learner_s_skips(tmp_path, monkeypatch):
    """After an update the policy may have diverged (an lr of 1e30 makes every later rollout NaN): the learner's
    non-finite loss skips the update and train.max_skipped_steps decides (tests/trainer/test_divergence.py)."""
    def spoil(batch):
        batch.latents[3, 1, 2, 0] = np.inf

    trained = []
    run_dir = _run(tmp_path, monkeypatch, trained, broken=2, spoil=spoil)
    assert trained == [0, 1, 2] and _written(run_dir) == ["1", "2", "3", "lora_final"]


def test_only_the_float_fields_the_loss_reads_are_checked():
    batch = trajectory(4, 0, 0)
    assert nonfinite_rows(batch) == {}
    batch.sigmas[1] = np.nan  # shared by every row (the schedule's checks refuse it where a batch crosses over)
    batch.log_probs[2, 1] = np.inf
    assert nonfinite_rows(batch) == {"sigmas": 4, "log_probs": 1}


def test_a_quantized_engine_is_named_with_the_setting_to_try():
    message = str(rollout_not_finite(1, {"log_probs": 640}, 640, "vllm_omni", "fp8", "layers"))
    assert "from the vllm_omni engine (rollout.quantization=fp8, LoRA served as layers)" in message
    assert message.endswith("; try --config.rollout.quantization=none or check the engine's log")


@pytest.mark.slow
def test_the_command_line_prints_one_line_and_exits_1(tmp_path):
    imports = "from jaxflow.trainer.divergence import rollout_not_finite"
    out = cli_run_raising(tmp_path, imports, "rollout_not_finite(1, {'log_probs': 8}, 8, 'vllm_omni', 'fp8', "
                                             "'layers')")
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert out.returncode == 1 and len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert errors[0].startswith("error: step 1's rollout returned non-finite values (log_probs: 8 of 8 rows)")
