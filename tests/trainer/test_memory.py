"""The memory check before the first rollout (jaxflow/trainer/memory.py): XLA's analysis of the compiled step against JAX's
pool; a step that cannot fit stops the run with one line naming the knobs, exit 2, nothing written."""
import subprocess
import sys

import numpy as np
import pytest

from jaxflow.trainer import memory
from tests.helpers import ROOT, run, tiny_config
from tests import HANG_S

GIB = 2 ** 30


def test_need_counts_new_arguments_temporaries_and_unaliased_outputs():
    plan = memory.StepMemory("update", arguments=50 * GIB, outputs=6 * GIB, aliased=5 * GIB, temp=30 * GIB)
    assert plan.need(resident=40 * GIB) == (10 + 30 + 1) * GIB
    assert plan.need(resident=60 * GIB) == 31 * GIB  # never negative for what already lies there


def test_check_fits_names_the_knobs_when_short_and_summarises_when_not():
    plans = [memory.StepMemory("old_log_prob", 45 * GIB, 0, 0, 5 * GIB),
             memory.StepMemory("update", 45 * GIB, 5 * GIB, 5 * GIB, 30 * GIB)]
    line = memory.check_fits(plans, 40 * GIB, limit=80 * GIB, in_use=40 * GIB, what="8 samples")
    assert "update needs 35.0 GiB" in line and "5.0 GiB to spare" in line and "\n" not in line
    with pytest.raises(MemoryError) as e:
        memory.check_fits(plans, 40 * GIB, limit=70 * GIB, in_use=40 * GIB, what="8 samples")
    msg = str(e.value)
    assert "5.0 GiB short" in msg and "spare" not in msg and "train.num_micro_batches" in msg and "XLA_CLIENT_MEM_FRACTION" in msg
    assert "\n" not in msg


@pytest.mark.slow
def test_the_loop_runs_the_executables_the_check_compiled(tmp_path, monkeypatch):
    """The check compiles the step for the run's real batch shapes (a wrong shape or dtype would fail the first
    step's call of the compiled executable, which does not retrace), and the run trains with them."""
    compiled = {}
    real = memory.StepMemory.of

    def spy(name, c):
        compiled[name] = c
        return real(name, c)

    monkeypatch.setattr(memory.StepMemory, "of", staticmethod(spy))
    cfg = tiny_config(tmp_path / "run", num_steps=1, num_mini_batches=2, num_micro_batches=2,
                      old_log_prob="recompute")
    cfg.rollout.layout = "in_process"
    out = run(cfg)
    assert sorted(compiled) == ["old_log_prob", "update"] and out["history"][0]["skipped"] == 0
    assert all(c.memory_analysis().temp_size_in_bytes > 0 for c in compiled.values())


@pytest.mark.slow
def test_a_step_that_does_not_fit_exits_2_before_the_rollout_with_nothing_written(tmp_path):
    """A pool of 1 MiB (what a GPU backend reports, made small): one line on stderr naming the knobs, exit 2, no
    run_dir, and no rollout engine started (the command line in a process of its own, its pool patched)."""
    run_dir = tmp_path / "run"
    code = ("import sys; from jaxflow.run import cli, driver; from jaxflow.trainer import memory; from jaxflow.train import Trainer; "
            "memory.pool = lambda device=None: (2 ** 20, 0); "
            "driver.Driver.launch_rollout = lambda *a: sys.exit('rollout started'); "
            "sys.exit(cli.main(Trainer))")
    out = subprocess.run([sys.executable, "-c", code, f"--config.run_dir={run_dir}", "--config.rollout.layout=in_process",
                          "--config.reward.fns={'jpeg_incompressibility': 1.0}", "--config.log.progress=False"],
                         cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(err) == 1 and err[0].startswith("error: train step memory per device"), err
    assert "does not fit" in err[0] and "train.num_micro_batches" in err[0]
    assert not run_dir.exists()


def test_abstract_batch_matches_prepare_batch():
    """The shapes the check compiles for are the ones `prepare_batch` produces from a rollout's batch."""
    import ml_dtypes

    from jaxflow.trainer.step_config import TrainConfig
    from jaxflow.trainer.train_batch import TrainBatch
    from jaxflow.trainer.train_step import prepare_batch
    b, w, n, s, c, length, neg, d = 4, 2, 6, 10, 8, 5, 3, 16
    bf16 = np.dtype(ml_dtypes.bfloat16)
    spec, old = memory.abstract_batch(batch=b, window=w, num_steps=n, seq=s, channels=c, text=length, width=d,
                                      embed_dtype=bf16, guided=True, recompute=True, negative_text=neg)
    raw = {"latents": np.zeros((b, w + 1, s, c), np.float32), "log_probs": np.zeros((b, w), np.float32),
           "sigmas": np.linspace(1, 0, n + 1).astype(np.float32), "step_index": np.zeros((b, w), np.int64),
           "noise_level": np.float32(0.7), "advantages": np.zeros(b, np.float32),
           "prompt_embeds": np.zeros((b, length, d), bf16), "prompt_mask": np.ones((b, length), bool),
           "negative_prompt_embeds": np.zeros((b, neg, d), bf16),
           "negative_prompt_mask": np.ones((b, neg), bool)}
    got = prepare_batch(TrainBatch(**raw), TrainConfig(grid_hw=(2, 5), guidance=4.0))
    assert {k: (v.shape, v.dtype) for k, v in got.items()} == {k: (v.shape, v.dtype) for k, v in spec.items()}
    assert old["log_probs"].shape == (b, w) and set(old) == {"log_probs"}
    _, old = memory.abstract_batch(batch=b, window=w, num_steps=n, seq=s, channels=c, text=length, width=d,
                                   embed_dtype=bf16, guided=True, recompute=True, means=True)
    assert old["means"].shape == (b, w, s, c)


@pytest.mark.parametrize("nft", [False, True])
def test_abstract_batch_matches_prepare_batch_with_token_ids(nft):
    """BAGEL's batch: token ids (B, L) int32 (cast from int64) and masks in place of the embeds; the empty negative
    context padded to its text length; a missing negative named as such."""
    from jaxflow.trainer.step_config import TrainConfig
    from jaxflow.trainer.train_batch import TrainBatch
    from jaxflow.trainer.train_step import prepare_batch
    b, w, n, s, c, length, neg = 4, 2, 6, 10, 64, 5, 3
    spec, _ = memory.abstract_batch(batch=b, window=w, num_steps=n, seq=s, channels=c, text=length, width=None,
                                    embed_dtype=None, guided=not nft, recompute=False, nft=nft, negative_text=neg,
                                    text_ids=True)
    raw = {"latents": np.zeros((b, w + 1, s, c), np.float32), "log_probs": np.zeros((b, w), np.float32),
           "sigmas": np.linspace(1, 0, n + 1).astype(np.float32), "step_index": np.zeros((b, w), np.int64),
           "noise_level": np.float32(0.7), "advantages": np.zeros(b, np.float32),
           "final_latents": np.zeros((b, s, c), np.float32),
           "prompt_ids": np.ones((b, length), np.int64), "prompt_mask": np.ones((b, length), bool)}
    config = (TrainConfig(guidance=1.0, grid_hw=(2, 5), algorithm="nft", sde_type="ode") if nft
              else TrainConfig(grid_hw=(2, 5), guidance=4.0))
    if not nft:
        with pytest.raises(ValueError, match=r"missing \['negative_prompt_ids', 'negative_prompt_mask'\] \(guidance"):
            prepare_batch(TrainBatch(**raw), config)
        raw.update(negative_prompt_ids=np.zeros((b, neg), np.int32), negative_prompt_mask=np.zeros((b, neg), bool))
    got = prepare_batch(TrainBatch(**raw), config)
    assert {k: (v.shape, v.dtype) for k, v in got.items()} == {k: (v.shape, v.dtype) for k, v in spec.items()}
    assert spec["prompt_ids"].dtype == np.int32 and "prompt_embeds" not in spec
    assert "prompt_ids" in TrainBatch(**raw).per_sample()  # the learner shares per_sample(batch) between processes


def test_sleep_is_flagged_where_a_fixed_pool_cannot_use_the_freed_memory(tmp_path, monkeypatch):
    """The rule for rollout.sleep_while_training: on a GPU with JAX's preallocated pool (the default) the engine's
    freed memory has no taker, so the trainer warns; without preallocation, off, or on the CPU it says nothing."""
    from jaxflow import train
    cfg = tiny_config(tmp_path)
    cfg.rollout.sleep_while_training = True
    monkeypatch.setattr(train.jax, "default_backend", lambda: "gpu")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    assert "sleep_while_training=False" in train.sleep_warning(cfg)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    assert train.sleep_warning(cfg) is None
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    cfg.rollout.sleep_while_training = False
    assert train.sleep_warning(cfg) is None
    cfg.rollout.sleep_while_training = True
    monkeypatch.setattr(train.jax, "default_backend", lambda: "cpu")
    assert train.sleep_warning(cfg) is None


@pytest.mark.slow
@pytest.mark.parametrize("message", ["RESOURCE_EXHAUSTED: Out of memory while trying to allocate 62.07GiB.",
                                     "CUDA out of memory. Tried to allocate 2.00 GiB"])
def test_out_of_memory_in_the_loop_is_one_line_exit_1(tmp_path, message):
    """A device OOM inside the loop (XLA's or torch's, here raised by a stand-in loop after start-up) ends with one
    line naming the knobs and --resume, exit 1, no traceback."""
    code = ("import sys; from jaxflow.run import cli\n"
            "class T:\n"
            "    driver, start = None, 0\n"
            "    def __init__(self, cfg, resume=False): pass\n"
            f"    def run(self): raise RuntimeError('several lines\\n{message}\\nmore')\n"
            "    def close(self): pass\n"
            "sys.exit(cli.main(T))")
    out = subprocess.run([sys.executable, "-c", code, f"--config.run_dir={tmp_path / 'run'}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=HANG_S)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(err) == 1 and "Traceback" not in out.stderr, out.stderr
    assert err[0].startswith("error: out of device memory in the training loop") and message[:20] in err[0]
    assert "--resume" in err[0] and "train.num_micro_batches" in err[0]
