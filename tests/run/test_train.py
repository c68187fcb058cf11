"""The training program on the tiny offline model: validation, a short run with eval/export (the learning test:
test_learning.py), exact resume, kill -9 + resume, a rollout actor killed mid-step, an unreachable reward server."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from jaxflow.config import derived
from jaxflow.config import plan as plan_lib
from jaxflow.config import validation as config_lib
from jaxflow.train import Trainer
from tests.helpers import ROOT, run, tiny_config
from tests import HANG_S


def lora_leaves(state):
    import jax
    return [np.asarray(x) for x in jax.tree.leaves(state.lora)]


@pytest.mark.parametrize("key, value, needle", [
    ("model.path", "", "configs/tiny_ocr.py"),
    ("model.path", "/nonexistent/qwen", "configs/tiny_ocr.py"),
    ("sample.group_size", 1, "sample.group_size"),
    ("train.num_micro_batches", 3, "train.num_micro_batches"),
    ("sample.window_size", 9, "sample.window_size"),
    ("model.init", "zeros", "model.init"),
    ("model.scan_unroll", -1, "scan_unroll"),
    ("eval.every", -1, "0: no eval"),
    ("train.xla_options", {"gpu_enable_triton_gemm": False}, "train.xla_options"),
    ("train.adam_b2", 1.0, "adam_b2 < 1"),
    ("train.max_minutes", -1.0, "train.max_minutes"),
    ("train.max_skipped_steps", -1, "config.train.max_skipped_steps: must be an int >= 0"),
    ("train.sync_fault_from", -1, "config.train.sync_fault_from: must be an int >= 0"),
    ("model.dtype", "fp16", "config.model.dtype: 'fp16'"),
    ("model.remat", "bogus", "config.model.remat: 'bogus'"),
    ("lora.rank", 0, "config.lora.rank"),
    ("train.old_log_prob", "foo", "config.train.old_log_prob: 'foo'"),
    ("sample.height", 41, "config.sample.height: height and width must be positive multiples of 8"),
    ("sample.guidance", 0.5, "config.sample.guidance"),
    ("sample.negative_max_sequence_length", 97, "config.sample.negative_max_sequence_length: 97 must be in"),
    ("rollout.device", "tpu", "config.rollout.device"),
    ("rollout.cfg_forward", "both", "config.rollout.cfg_forward: 'both'"),
    ("data.train", "", "config.data.train: '' is not a file"),
    ("train.algorithm", "nft", "config.sample.guidance: 4.0; NFT trains and samples a CFG-free policy"),
    ("train.algorithm", "dpo", "config.train.algorithm: 'dpo'"),
    ("rollout.engine", "sglang", "config.rollout.engine: 'sglang'; choose one of"),
])
def test_invalid_config_fails_before_anything_heavy(tmp_path, key, value, needle):
    cfg = tiny_config(tmp_path)
    section, name = key.split(".")
    cfg[section][name] = value
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        config_lib.validate(cfg)


def test_adam_settings_reach_the_train_config(tmp_path):
    cfg = tiny_config(tmp_path)
    cfg.train.adam_b1, cfg.train.adam_b2, cfg.train.adam_eps = 0.8, 0.99, 1e-6
    t = derived.train_config(cfg, grid_hw=(2, 2))
    assert (t.adam_b1, t.adam_b2, t.adam_eps) == (0.8, 0.99, 1e-6)


def test_vllm_omni_takes_random_init_in_bf16_and_no_compile(tmp_path):
    cfg = tiny_config(tmp_path)
    cfg.model.init, cfg.rollout.engine, cfg.rollout.device = "random", "vllm_omni", "cuda"
    with pytest.raises(ValueError, match=r"rollout\.dtype.*bfloat16 only"):
        config_lib.validate(cfg)
    cfg.rollout.dtype = "bfloat16"
    config_lib.validate(cfg)  # random base weights: the engine draws them on its GPU (fingerprint-checked)
    cfg.model.init, cfg.rollout.compile = "checkpoint", True
    with pytest.raises(ValueError, match="rollout.compile"):
        config_lib.validate(cfg)


def test_same_latent_is_a_bool_and_reaches_the_rollout(tmp_path):
    from jaxflow_bridge.rollout.sampling import SamplingParams
    cfg = tiny_config(tmp_path)
    cfg.sample.same_latent = True
    assert SamplingParams.from_dict(derived.sampling(cfg)).same_latent
    assert not derived.sampling(cfg, eval_mode=True)["same_latent"]  # eval: one sample per prompt
    cfg.sample.same_latent = None  # ConfigDict refuses an int here, not None
    with pytest.raises(ValueError, match=r"sample\.same_latent: None must be a bool"):
        config_lib.validate(cfg)


def test_jax_on_cpu_with_a_cuda_rollout_is_refused(tmp_path, monkeypatch):
    import jax

    from jaxflow.train import check_backend
    cfg = tiny_config(tmp_path)
    check_backend(cfg)  # cpu rollout, cpu JAX: fine
    cfg.rollout.device = "cuda"
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    with pytest.raises(config_lib.UserError, match="XLA_PYTHON_CLIENT_MEM_FRACTION") as e:
        check_backend(cfg)
    assert "\n" not in str(e.value) and "--config.rollout.device=cpu" in str(e.value)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    check_backend(cfg)


def test_the_cpu_overrides_named_for_qwen_ocr_are_all_it_needs(tmp_path):
    """Following the hint of a GPU recipe on a CPU machine leads to no second error: qwen_ocr with every override
    the message names validates, and its model options build a model on the CPU."""

    from flax import nnx

    from jaxflow.families.qwen_image.config import QwenImageConfig
    from jaxflow.families.qwen_image.transformer import QwenImageTransformer
    from jaxflow.train import CPU_OVERRIDES
    from tests.qwen_ref import TINY
    cfg = config_lib.config_module(ROOT / "configs" / "qwen_ocr.py").get_config()
    cfg.model.path = "tiny"
    for item in CPU_OVERRIDES.split():
        key, value = item.removeprefix("--config.").split("=", 1)
        section, name = key.split(".")
        cfg[section][name] = {} if value == "{}" else type(cfg[section][name])(value) if not isinstance(
            cfg[section][name], bool) else value == "True"
    config_lib.validate(cfg)
    tiny = QwenImageConfig(**TINY)
    gemm, why = plan_lib.lora_gemm(cfg, tiny.num_layers, 1, False, 4, (64, 96))  # as the trainer resolves "auto"
    assert gemm == "xla" and "not an H100/H200" in why
    QwenImageTransformer(tiny, derived.model_options(cfg, gemm, tiny.num_layers), derived.lora_spec(cfg), rngs=nnx.Rngs(0))


def test_unknown_reward_names_the_known_ones(tmp_path):
    cfg = tiny_config(tmp_path)
    cfg.reward.fns = {"nope": 1.0}
    with pytest.raises(ValueError, match="jpeg_incompressibility"):
        config_lib.validate(cfg)


@pytest.mark.slow
def test_short_run_logs_evaluates_checkpoints_and_exports(ray_session, tmp_path):
    cfg = tiny_config(tmp_path, num_steps=2)
    cfg.eval.every, cfg.checkpoint.every = 1, 1
    out = run(cfg)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]  # one step convention: completed updates, 1..num_steps
    for key in ("loss", "policy_loss", "approx_kl", "clipfrac", "ratio_mean", "logp_diff_max/1", "grad_norm",
                "reward_mean", "eval_reward_mean", "time/rollout", "time/train", "time/to_device", "time/update",
                "time/sync", "bound_modules"):
        assert key in lines[0], key
    assert lines[0]["logp_diff_max/0"] < 1e-5 and lines[0]["skipped"] == 0  # fp32 rollout == trainer recompute
    evals = sorted(int(p.stem.split("_")[1]) for p in (tmp_path / "eval").glob("step_*.png"))
    assert evals == [x["step"] for x in lines if "eval_reward_mean" in x] == [1, 2]
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [1, 2]
    assert json.loads((tmp_path / "lora_final" / "adapter_config.json").read_text())["r"] == cfg.lora.rank
    assert out["state"].step == 2


@pytest.mark.slow
def test_in_process_rollout_with_random_init_runs_without_ray(tmp_path):
    """No Ray, and `model.init=random`: both sides draw the base weights (the start-up fingerprint check passes)
    and the rollout's log-probs equal the trainer's recompute, so they drew the same model."""
    cfg = tiny_config(tmp_path, num_steps=1)
    cfg.rollout.layout, cfg.model.init, cfg.seed = "in_process", "random", 7
    out = run(cfg)
    assert out["history"][0]["skipped"] == 0 and out["history"][0]["logp_diff_max/0"] < 1e-5
    assert (tmp_path / "eval" / "step_000001.png").exists()  # the final step is evaluated, eval.every or not


@pytest.mark.slow  # a whole Trainer (driver, in-process engine, learner) for its steps
@pytest.mark.parametrize("sleep", [True, False])
def test_the_rollout_is_idle_exactly_while_the_learner_trains(tmp_path, monkeypatch, sleep):
    """rollout.sleep_while_training: each step the engines sleep after the rollout and its rewards, the learner
    trains, then they wake before the LoRA sync; the phases and the freed memory are logged. Without it the engines
    are told the step's rollouts are over (release_adapter: a merged adapter's base restores meanwhile)."""
    from jaxflow.run.driver import Driver
    from jaxflow.trainer.learner import Learner
    from jaxflow.run.rollout_client import RolloutGroup

    events = []
    for cls, name in ((RolloutGroup, "sleep"), (RolloutGroup, "wake"), (RolloutGroup, "generate"),
                      (RolloutGroup, "release_adapter"), (Learner, "train"), (Driver, "serve")):
        def record(self, *args, _name=name, _original=getattr(cls, name), **kwargs):
            events.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(cls, name, record)
    cfg = tiny_config(tmp_path, num_steps=2)
    cfg.rollout.layout, cfg.rollout.sleep_while_training, cfg.eval.every = "in_process", sleep, 0
    out = run(cfg)
    steps = events[events.index("serve") + 1:]  # after the start-up sync
    idle = ["generate", "sleep", "train", "wake", "serve"] if sleep else ["generate", "release_adapter", "train", "serve"]
    assert steps == idle * 2, events
    for metrics in out["history"]:
        if sleep:
            assert metrics["rollout_freed_gib"] == 0 and metrics["time/sleep"] >= 0 and metrics["time/wake"] >= 0


@pytest.mark.slow
def test_max_minutes_ends_the_run_like_a_finished_one(tmp_path):
    """A time limit shorter than a step: the run ends after its first step of three, with that step's checkpoint
    and lora_final written (a run cut by a signal writes no lora_final)."""
    cfg = tiny_config(tmp_path, num_steps=3)
    cfg.rollout.layout, cfg.train.max_minutes, cfg.checkpoint.every = "in_process", 1e-6, 1000
    out = run(cfg)
    assert [h["step"] for h in out["history"]] == [1] and out["state"].step == 1
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [1]
    assert json.loads((tmp_path / "lora_final" / "adapter_config.json").read_text())["r"] == cfg.lora.rank
    first = (tmp_path / "lora_final" / "adapter_model.safetensors").read_bytes()
    cfg.train.max_minutes = 0.0  # --resume continues it to num_steps and exports the LoRA trained on
    cfg.eval.every = 0  # no eval, not even of the final policy
    again = run(cfg, resume=True)
    assert [h["step"] for h in again["history"]] == [2, 3] and again["state"].step == 3
    assert not (tmp_path / "eval").exists() and "eval_reward_mean" not in again["history"][-1]
    assert (tmp_path / "lora_final" / "adapter_model.safetensors").read_bytes() != first


@pytest.mark.slow
def test_ema_is_what_the_eval_serves_and_the_export_writes(tmp_path, monkeypatch):
    """train.ema_decay: each eval serves the LoRA's EMA and then the LoRA again (the next rollout samples the
    policy being trained); lora_final holds the EMA, as flow_grpo evaluates and saves its EMA."""
    from jaxflow.run.driver import Driver
    from jaxflow.nn.lora import lora_to_peft
    from jaxflow.families.qwen_image.lora import read_peft

    events = []
    serve, evaluate = Driver.serve, Driver.evaluate

    def recording_serve(self, lora, version):
        events.append(("serve", version, lora_to_peft(lora, self.spec)))
        return serve(self, lora, version)

    def recording_evaluate(self, step):
        events.append(("eval", step, None))
        return evaluate(self, step)

    monkeypatch.setattr(Driver, "serve", recording_serve)
    monkeypatch.setattr(Driver, "evaluate", recording_evaluate)
    cfg = tiny_config(tmp_path, num_steps=2, learning_rate=3e-3, ema_decay=0.5)
    cfg.rollout.layout, cfg.eval.every = "in_process", 1
    out = run(cfg)
    spec, final = read_peft(tmp_path / "lora_final")
    ema, raw = lora_to_peft(out["state"].ema, spec), lora_to_peft(out["state"].lora, spec)
    changed = [k for k in raw if not np.allclose(raw[k], ema[k])]
    assert changed, "the EMA equals the LoRA: the test cannot tell them apart"
    for k in raw:
        np.testing.assert_array_equal(final[k], ema[k])
    evals = [i for i, e in enumerate(events) if e[0] == "eval"]
    assert [events[i][1] for i in evals] == [1, 2]
    for i in evals:  # train-step serve, EMA serve, eval, serve of the LoRA again: same version throughout
        before, for_eval, after = events[i - 2], events[i - 1], events[i + 1]
        assert before[0] == for_eval[0] == after[0] == "serve" and before[1] == for_eval[1] == after[1] == events[i][1]
        assert any(not np.allclose(before[2][k], for_eval[2][k]) for k in changed)
        for k in raw:
            np.testing.assert_array_equal(after[2][k], before[2][k])
    for k in raw:
        np.testing.assert_array_equal(events[evals[-1] - 1][2][k], ema[k])


@pytest.mark.slow
def test_nft_samples_with_the_old_policy_and_evaluates_and_exports_the_lora(tmp_path, monkeypatch):
    """train.algorithm='nft': the rollout samples with the old policy (TrainState.old; after the first step of a
    flat decay start it equals the LoRA, later it trails it), each eval serves the LoRA, which lora_final holds;
    a resume restores the old policy."""
    from jaxflow.run.driver import Driver
    from jaxflow.nn.lora import lora_to_peft
    from jaxflow.families.qwen_image.lora import read_peft

    served = []
    serve = Driver.serve
    monkeypatch.setattr(Driver, "serve", lambda self, lora, version: (
        served.append((version, lora_to_peft(lora, self.spec))), serve(self, lora, version))[1])
    cfg = tiny_config(tmp_path, num_steps=2, learning_rate=3e-3, algorithm="nft")
    cfg.train.nft.update(decay_flat=1, decay_rate=0.5, decay_max=0.5)  # after 2 updates old = (old + lora) / 2
    cfg.train.nft.ema = 0.0  # evals and lora_final take the raw LoRA (the EMA, nft's default: test_nft.py)
    cfg.rollout.layout, cfg.sample.guidance, cfg.sample.sde_type, cfg.eval.every = "in_process", 1.0, "ode", 2
    out = run(cfg)
    spec = read_peft(tmp_path / "lora_final")[0]
    old, lora = lora_to_peft(out["state"].old, spec), lora_to_peft(out["state"].lora, spec)
    assert any(not np.allclose(old[k], lora[k]) for k in lora)
    assert [v for v, _ in served] == [0, 1, 2, 2, 2]  # start, after step 1, after step 2, eval, back
    for k in lora:
        np.testing.assert_array_equal(read_peft(tmp_path / "lora_final")[1][k], lora[k])
        np.testing.assert_array_equal(served[2][1][k], old[k])
        np.testing.assert_array_equal(served[3][1][k], lora[k])
        np.testing.assert_array_equal(served[4][1][k], old[k])
    assert {"old_deviate", "policy_loss", "kl"} <= set(out["history"][-1]) and "ratio_mean" not in out["history"][-1]
    cfg.train.num_steps = 3
    resumed = run(cfg, resume=True)
    assert resumed["history"][0]["step"] == 3 and resumed["history"][0]["old_deviate"] > 0  # old != LoRA restored


@pytest.mark.slow
def test_resume_continues_exactly(ray_session, tmp_path):
    full = run(tiny_config(tmp_path / "full", num_steps=4))
    first = tiny_config(tmp_path / "split", num_steps=2)
    run(first)
    resumed = run(tiny_config(tmp_path / "split", num_steps=4), resume=True)
    assert [h["step"] for h in resumed["history"]] == [3, 4]
    for a, b in zip(lora_leaves(full["state"]), lora_leaves(resumed["state"])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert abs(full["history"][-1]["reward_mean"] - resumed["history"][-1]["reward_mean"]) < 1e-6


@pytest.mark.slow
def test_resume_of_a_run_stopped_before_its_export_writes_lora_final(ray_session, tmp_path):
    first = run(tiny_config(tmp_path, num_steps=2, learning_rate=3e-3))
    final = tmp_path / "lora_final"
    exported = {p.name: p.read_bytes() for p in final.iterdir()}
    for p in final.iterdir():
        p.unlink()
    final.rmdir()
    rows = (tmp_path / "metrics.jsonl").read_text()
    again = run(tiny_config(tmp_path, num_steps=2, learning_rate=3e-3), resume=True)
    assert again["history"] == [] and (tmp_path / "metrics.jsonl").read_text() == rows  # no step ran
    assert {p.name: p.read_bytes() for p in final.iterdir()} == exported  # the checkpoint's LoRA, as before
    for a, b in zip(lora_leaves(first["state"]), lora_leaves(again["state"])):
        np.testing.assert_array_equal(a, b)


def _cli(ray_session, run_dir, *extra):
    address = ray_session.get_runtime_context().gcs_address
    return [sys.executable, "-m", "jaxflow.train", "--config", str(ROOT / "configs" / "tiny_ocr.py"),
            f"--config.run_dir={run_dir}", "--config.train.num_steps=6", "--config.eval.every=1000",
            "--config.log.progress=False", "--config.log.tensorboard=False", "--config.rollout.num_cpus=0",
            f"--config.rollout.address={address}", f"--config.data.train={ROOT / 'data/ocr/train.txt'}",
            f"--config.data.test={ROOT / 'data/ocr/test.txt'}",
            "--config.reward.fns={'jpeg_incompressibility': 1.0}", *extra]


def _wait_for_steps(proc, metrics, count):
    deadline = time.time() + 300
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < count):
        assert proc.poll() is None, "trainer exited early"
        time.sleep(0.2)
    return len(metrics.read_text().splitlines())


@pytest.mark.slow
def test_kill_9_mid_run_then_resume_loses_at_most_one_step(ray_session, tmp_path):
    args = _cli(ray_session, tmp_path, "--config.checkpoint.every=1")
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = tmp_path / "metrics.jsonl"
    done = _wait_for_steps(proc, metrics, 3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    saved = max(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert saved >= done - 1, f"{done} steps were logged before the kill, the newest checkpoint is {saved}"
    resumed = subprocess.run(args + ["--resume"], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # one row per step: rows after the checkpoint were logged again


@pytest.mark.slow
def test_sigterm_checkpoints_the_current_step_and_exits(ray_session, tmp_path):
    proc = subprocess.Popen(_cli(ray_session, tmp_path, "--config.checkpoint.every=1000"), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_steps(proc, tmp_path / "metrics.jsonl", 2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=HANG_S) == 75  # stopped, resumable: not the 0 of a finished run
    logged = len((tmp_path / "metrics.jsonl").read_text().splitlines())
    saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == [logged] and logged < 6  # stopped early, after checkpointing the step it had finished


@pytest.mark.slow
def test_a_second_signal_stops_at_once_with_130_and_one_line(tmp_path):
    """The first SIGINT/SIGTERM asks for a stop after the step; a second raises KeyboardInterrupt at once, which the
    command line turns into one line and exit 130 (here from a stand-in loop, so the timing is the test's)."""
    trainer = Trainer.__new__(Trainer)
    trainer.stop_requested = False
    trainer._request_stop(signal.SIGINT, None)
    assert trainer.stop_requested
    with pytest.raises(KeyboardInterrupt):
        trainer._request_stop(signal.SIGINT, None)
    code = ("import sys; from jaxflow.run import cli\n"
            "class T:\n"
            "    driver, start = None, 0\n"
            "    def __init__(self, cfg, resume=False): pass\n"
            "    def run(self): raise KeyboardInterrupt\n"
            "    def close(self): pass\n"
            "sys.exit(cli.main(T))")
    out = subprocess.run([sys.executable, "-c", code, f"--config.run_dir={tmp_path / 'run'}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=HANG_S)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 130 and len(err) == 1 and err[0].startswith("error: interrupted"), out.stderr


@pytest.mark.slow
def test_rollout_actor_killed_mid_generate_is_restarted_and_retried(ray_session, tmp_path):
    import ray
    trainer = Trainer(tiny_config(tmp_path, num_steps=1))
    try:
        victim = trainer.driver.rollout.servers[0]
        threading.Timer(0.5, lambda: ray.kill(victim, no_restart=True)).start()
        metrics = trainer.train_one(0)
        assert trainer.driver.rollout.servers[0] is not victim
        assert metrics["skipped"] == 0 and np.max(metrics["logp_diff_max"]) < 1e-5  # one policy after the restart
        assert metrics["rollout/versions"] == 1 and metrics["staleness"] == 0  # every sample the step's policy's
    finally:
        trainer.close()


@pytest.mark.slow
def test_one_of_two_engines_killed_after_an_update_loses_no_step_and_mixes_no_versions(ray_session, tmp_path,
                                                                                      monkeypatch):
    """Two rollout actors; after the first update one is dead at the next step's first call to it (its rollout or
    its sync): the call is retried on fresh actors that get the current LoRA (version 1) again before generating, so
    every sample of the step is version 1 and the trainer's recompute matches it (fp32). The kill waits for the
    actor's death before that call goes out (a timer could land after the step's last call: no death seen)."""
    import ray
    cfg = tiny_config(tmp_path, num_steps=2)
    cfg.rollout.num_servers = 2
    trainer = Trainer(cfg)
    try:
        trainer.train_one(0)
        victim, transport, killed = trainer.driver.rollout.servers[1], trainer.driver.rollout.transport, []
        submit = transport.submit

        def kill_first(server, method, *args):
            if server is victim and not killed:
                killed.append(method)
                ray.kill(victim, no_restart=True)
                with pytest.raises(ray.exceptions.RayActorError):
                    for _ in range(100):  # until the actor is gone
                        ray.get(victim.info.remote(), timeout=30)
                        time.sleep(0.1)
            return submit(server, method, *args)

        monkeypatch.setattr(transport, "submit", kill_first)
        metrics = trainer.train_one(1)
        assert killed  # the step called the victim
        assert victim not in trainer.driver.rollout.servers and len(trainer.driver.rollout.servers) == 2
        assert metrics["skipped"] == 0 and np.max(metrics["logp_diff_max"]) < 1e-5
        assert metrics["rollout/versions"] == 1 and metrics["staleness"] == 0
    finally:
        trainer.close()


def test_unreachable_reward_server_fails_fast_naming_the_url(tmp_path):
    cfg = tiny_config(tmp_path)
    cfg.reward.fns = {"vlm_ocr": 1.0}
    cfg.reward.options = {"vlm_ocr": {"base_url": "http://127.0.0.1:9", "model": "judge", "timeout": 2}}
    t = time.time()
    with pytest.raises(RuntimeError, match="127.0.0.1:9"):
        Trainer(cfg)
    assert time.time() - t < 30


@pytest.mark.slow
def test_overlap_trains_each_batch_against_the_policy_that_sampled_it(ray_session, tmp_path):
    """rollout.overlap: step k+1's rollout runs while step k trains. From the second step on every batch is one
    version old (staleness 1, never 2), and logp_old comes from the LoRA that sampled it: the recompute pass matches
    the rollout's log-probs to fp32 rounding, while the trained policy has already moved away from them."""
    cfg = tiny_config(tmp_path, num_steps=3, num_mini_batches=2, old_log_prob="recompute", learning_rate=1e-2)
    cfg.rollout.layout, cfg.rollout.overlap = "split", True  # on the CPU both sides share it anyway
    history = run(cfg)["history"]
    assert [row["staleness"] for row in history] == [0, 1, 1]
    for row in history:
        assert row["old_logp_diff_max"] < 1e-5, row  # logp_old is the sampling policy's
    moved = [max(v for k, v in row.items() if k.startswith("logp_diff_max/")) for row in history[1:]]
    assert min(moved) > 10 * max(row["old_logp_diff_max"] for row in history[1:]), moved


def test_the_colocated_layout_on_gpus_runs_one_engine_per_device(tmp_path):
    cfg = tiny_config(tmp_path)
    cfg.rollout.update(num_gpus=1.0, num_servers=1)
    config_lib.check_layout(cfg, "gpu", 1)  # the recipe on one GPU
    with pytest.raises(config_lib.UserError, match=r"rollout.num_servers: 1: the colocated layout runs one engine on "
                                                   r"each of the trainer's 8 GPUs: set --config.rollout.num_servers=8"):
        config_lib.check_layout(cfg, "gpu", 8)
    config_lib.check_layout(cfg, "cpu", 8)  # host devices: the engines share the CPU, any number
    cfg.rollout.layout = "split"
    config_lib.check_layout(cfg, "gpu", 8)


def test_auto_engines_are_one_per_gpu_where_colocated(tmp_path):
    from jaxflow.config import plan as plan_lib
    cfg = tiny_config(tmp_path)
    cfg.rollout.update(layout="colocated", num_gpus=1.0, num_servers="auto")
    config_lib.check_layout(cfg, "gpu", 8)  # the same command on any number of GPUs
    assert plan_lib.engines(cfg, "gpu", 8) == 8 and plan_lib.engines(cfg, "gpu", 1) == 1
    assert plan_lib.engines(cfg, "cpu", 8) == 1  # host devices share one engine
    cfg.rollout.num_servers = 3
    assert plan_lib.engines(cfg, "gpu", 8) == 3  # a set count is kept (check_layout refuses it colocated)
    cfg.rollout.update(layout="split", num_servers="auto")
    assert plan_lib.engines(cfg, "gpu", 8) == 1
    cfg.rollout.update(layout="colocated", num_gpus=0.0)
    assert plan_lib.engines(cfg, "gpu", 8) == 1  # engines asking Ray for no GPU


@pytest.mark.parametrize("changes, needle", [
    ({"overlap": True}, "rollout.overlap: runs the next rollout while the trainer trains: it needs rollout GPUs of "
                        "their own .rollout.layout='split'., not 'colocated'"),
    ({"overlap": True, "layout": "in_process"}, "rollout.overlap: .* not 'in_process'"),
    ({"layout": "split", "sleep_while_training": True}, "rollout.sleep_while_training: frees"),
    ({"layout": "in_process", "num_servers": 2}, "rollout.num_servers: 2: the in_process layout runs one engine"),
    ({"num_servers": "two"}, "rollout.num_servers: 'two'; give an int >= 1 or 'auto'"),
    ({"num_servers": 0}, "rollout.num_servers: 0; give an int >= 1 or 'auto'"),
    ({"num_servers": 2.5}, "rollout.num_servers: 2.5 must be an int or a str"),
    ({"num_servers": True}, "rollout.num_servers: True must be an int or a str"),
    ({"layout": "hybrid"}, "rollout.layout: 'hybrid'; choose one of \\('auto', 'colocated', 'split', 'in_process'\\)"),
    ({"lora_apply": "merged"}, "rollout.lora_apply: 'merged' is a mode of the vllm_omni engine; with "
                              "rollout.engine='diffusers' use 'auto' or 'layers'"),
    ({"lora_apply": "fused"}, "rollout.lora_apply: 'fused'; choose one of \\('auto', 'merged', 'layers', 'folder'\\)"),
])
def test_the_layout_refuses_what_it_cannot_run(tmp_path, changes, needle):
    cfg = tiny_config(tmp_path)
    cfg.rollout.update(changes)
    with pytest.raises(config_lib.UserError, match=needle):
        config_lib.validate(cfg)
    cfg.rollout.update(layout="split", sleep_while_training=False, num_servers=1, overlap=True, lora_apply="auto")
    config_lib.validate(cfg)  # the overlap of the split layout


def test_the_lora_mode_merges_on_vllm_omni_unless_told_layers(tmp_path):
    """rollout.lora_apply 'auto' (the recipe's) merges the LoRA into vLLM-Omni's weights and keeps LoRA layers on
    the diffusers engine; 'layers' keeps layers on vLLM-Omni too."""
    cfg = tiny_config(tmp_path)
    for engine, mode, merged in (("vllm_omni", "auto", True), ("diffusers", "auto", False),
                                 ("vllm_omni", "layers", False), ("vllm_omni", "merged", True)):
        cfg.rollout.engine, cfg.rollout.lora_apply = engine, mode
        assert plan_lib.merged_lora(cfg) is merged, (engine, mode)


def test_the_plan_resolves_the_lora_mode_into_the_engines_lora_apply(tmp_path):
    """rollout.lora_apply and the engines' lora_apply are one vocabulary (layers, merged, folder): the plan resolves
    'auto' into the family's mode on its engine and passes any other value as it is."""
    cfg = tiny_config(tmp_path)
    for engine, mode, apply in (("diffusers", "auto", "layers"), ("vllm_omni", "auto", "merged"),
                                ("diffusers", "folder", "folder"), ("vllm_omni", "folder", "folder"),
                                ("vllm_omni", "layers", "layers")):
        cfg.rollout.engine, cfg.rollout.lora_apply = engine, mode
        assert plan_lib.lora_apply(cfg) == apply, (engine, mode)
