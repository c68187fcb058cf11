"""FlowGRPO training: `python -m jaxflow.train --config configs/tiny_ocr.py [--config.a.b=v] [--resume]`.

Per step (docs/design.md §2): sample prompt groups -> rollout on the Ray actors (chunks feed the async reward pool as
they finish) -> advantages -> one jitted, sharded train step -> LoRA sync to the rollout (version acked,
bound-module count checked) -> metrics. Evaluation (ODE sampling on held-out prompts, a PNG grid) every
`eval.every` steps; orbax checkpoints every `checkpoint.every` steps and on SIGINT/SIGTERM; the final LoRA is
exported in PEFT format to `run_dir/lora_final`.

Multi-host (jax.distributed, one trainer process per host; see `maybe_initialize_distributed`): process 0 is the
driver. It alone holds the rollout group and the reward pool, samples, scores, computes advantages, logs, evaluates
and exports. Each step it broadcasts the train batch to every process (`share_batch`); every process feeds its own
contiguous rows to the sharded step (the global batch is their concatenation in process order), so the step is the
single-process step. All processes checkpoint and restore together (orbax); `run_dir` must be on a filesystem they
share.
"""
from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxflow import config as config_lib
from jaxflow import run_dir as run_dir_lib
from jaxflow.checkpoint import Checkpointer, config_json
from jaxflow.data import GroupSampler, load_prompts
from jaxflow.driver import merge_rewards, pad_text, sample_seeds
from jaxflow.flowgrpo import compute_advantages
from jaxflow.learner import build_model, grid_hw, share_batch
from jaxflow.lora_sync import device_peft_tensors, device_target
from jaxflow.metrics_log import RunLog, image_grid
from jaxflow.minibatches import order_minibatches
from jaxflow.models.loading import fingerprint
from jaxflow.models.lora import lora_to_peft, save_peft
from jaxflow.profiling import StepProfiler
from jaxflow.rewards import RewardPool, build_reward
from jaxflow.rollout_client import RolloutGroup, init_ray
from jaxflow.sharding import Layout, maybe_initialize_distributed
from jaxflow.train_step import make_train_step, per_sample

log = logging.getLogger("jaxflow.train")


def check_backend(cfg) -> None:
    """A rollout on a GPU with JAX on the CPU is a broken install or environment, not a choice: refuse it."""
    backend = jax.default_backend()
    if str(cfg.rollout.device).startswith("cuda") and backend == "cpu":
        raise RuntimeError("JAX runs on the CPU while rollout.device is cuda: JAX found no GPU. Install a CUDA jaxlib "
                           "(pip install 'jax[cuda13]'), and do not set both XLA_CLIENT_MEM_FRACTION and the "
                           "deprecated XLA_PYTHON_CLIENT_MEM_FRACTION (jax then falls back to the CPU); or set "
                           "--config.rollout.device=cpu to run both on the CPU")


class Trainer:
    """Holds the run's pieces; `run()` drives the loop. Build with `Trainer(cfg, resume)`."""

    def __init__(self, cfg, resume: bool = False):
        config_lib.validate(cfg)
        maybe_initialize_distributed()
        check_backend(cfg)
        self.processes, self.driver = jax.process_count(), jax.process_index() == 0
        if self.driver and not resume:  # never write into a previous run (the command line can --overwrite it)
            run_dir_lib.check_fresh(Path(cfg.run_dir))
        s = cfg.sample
        if (s.prompts_per_step * s.group_size) % self.processes:
            raise config_lib.UserError(f"the train batch (sample.prompts_per_step x sample.group_size = "
                                       f"{s.prompts_per_step * s.group_size}) must divide by the {self.processes} "
                                       f"JAX processes: each feeds an equal share of its rows")
        self.cfg, self.run_dir = cfg, Path(cfg.run_dir)
        self.folder = config_lib.model_folder(cfg)
        self.train_items, self.test_items = load_prompts(cfg.data.train), load_prompts(cfg.data.test)
        self.sampler = GroupSampler(len(self.train_items), s.prompts_per_step, s.group_size, cfg.seed)
        self.reward = self.pool = self.rollout = self.sync_target = None
        if self.driver:
            self.reward = build_reward(dict(cfg.reward.fns), **cfg.reward.options.to_dict())  # VLM health check
            self.pool = RewardPool(self.reward, cfg.reward.workers)
        self.layout = Layout.create(config_lib.sharding_config(cfg))
        self.spec = config_lib.lora_spec(cfg)
        self.model = build_model(cfg, self.folder / "transformer", self.spec, self.layout)
        o = self.model.opts
        log.info("trainer model: %s compute, %s storage, matmul precision %s, attention %s", o.dtype, o.param_dtype,
                 o.precision, self.model.impl)
        init_state, self.train_step = make_train_step(
            self.model, config_lib.train_config(cfg, grid_hw(self.folder, cfg)), self.layout)
        if self.driver:
            self.rollout = self._start_rollout()
        self.ckpt = Checkpointer(self.run_dir / "checkpoints", cfg.checkpoint.keep)
        self.state, self.start = init_state(), 0
        if resume:
            self.state, meta = self.ckpt.restore(self.state)
            self.start = meta["step"]
            self.sampler.load_state_dict(meta["sampler"])
        self._sync(self.start)  # the rollout serves exactly the trainer's policy before the first step
        self.stop_requested = False

    def _start_rollout(self) -> RolloutGroup:
        r = self.cfg.rollout
        if not r.in_process:
            init_ray(r.address)
        engine = {"engine": r.engine, "model": str(self.folder), "dtype": r.dtype, "device": r.device}
        if r.compile:
            engine["compile"] = True
        if self.cfg.model.init == "random":
            engine["random_seed"] = self.cfg.seed  # the rollout draws the same base weights (fingerprint below)
        group = RolloutGroup(engine, r.num_servers, r.num_cpus, r.num_gpus, r.max_retries, in_process=r.in_process)
        mine = fingerprint(self.model)
        infos = group.info()
        for info in infos:
            if info["fingerprint"] != mine:
                raise RuntimeError(f"rollout base weights ({info.get('model')}) differ from the trainer's "
                                   f"({self.folder}): fingerprint {info['fingerprint'][:12]} != {mine[:12]}")
        if r.in_process and self.processes == 1:  # the LoRA goes to the engine as device tensors (lora_sync)
            self.sync_target = device_target(infos[0])
        return group

    def _host_lora(self):
        """The LoRA state as host arrays; multi-process, a collective every process must join (the LoRA may be
        sharded over devices of several hosts)."""
        if self.processes == 1:
            return self.state.lora
        from jax.experimental import multihost_utils
        return jax.tree.map(np.asarray, multihost_utils.process_allgather(self.state.lora, tiled=True))

    def _sync(self, version: int) -> int | None:
        """The rollout serves the trainer's LoRA as policy `version`: device tensors through DLPack in process,
        host arrays otherwise (jaxflow/lora_sync.py)."""
        if self.sync_target is not None:
            return self.rollout.update_lora(device_peft_tensors(self.state.lora, self.spec, self.sync_target),
                                            version, self.spec.peft_config())
        lora = self._host_lora()
        if not self.driver:
            return None
        tensors = lora_to_peft(lora, self.spec)
        return self.rollout.update_lora(tensors, version, self.spec.peft_config())

    def _meta(self, step: int) -> dict:
        return {"step": step, "sampler": self.sampler.state_dict(), "config": config_json(self.cfg)}

    def _rollout(self, step: int, timings: dict):
        s = self.cfg.sample
        picks = self.sampler.sample(step)
        prompts = [self.train_items[picks[i * s.group_size][0]].prompt for i in range(s.prompts_per_step)]
        futures = {}
        t = time.perf_counter()
        batch = self.rollout.generate(
            prompts, s.group_size, config_lib.sampling(self.cfg), sample_seeds(self.cfg.seed, step, len(picks)),
            s.prompts_per_call, on_chunk=lambda c, b: futures.__setitem__(c, self.pool.submit(b.images, b.prompts)))
        timings["rollout"] = time.perf_counter() - t
        if batch.policy_version != step:
            raise RuntimeError(f"rollout served policy {batch.policy_version}, trainer is at {step}")
        t = time.perf_counter()
        rewards = merge_rewards(futures)
        timings["reward"] = time.perf_counter() - t
        return batch, rewards

    def _local_rows(self, train_batch: dict | None) -> dict:
        """Multi-process: process 0's train batch (the fields the step reads, each made per-sample) on every
        process, cut to this process's contiguous share of rows."""
        full = share_batch(None if train_batch is None else per_sample(train_batch))
        rows = len(full["advantages"]) // self.processes
        lo = jax.process_index() * rows
        return {k: v[lo:lo + rows] for k, v in full.items()}

    def _train_only(self, step: int) -> dict:
        """A non-driver process's step: receive its rows, train, join the LoRA gather; returns the metrics."""
        t = time.perf_counter()
        self.state, metrics = self.train_step(self.state, self._local_rows(None))
        metrics = jax.device_get(metrics)
        self._sync(step + 1)
        return {**metrics, "time/train": time.perf_counter() - t}

    def train_one(self, step: int) -> dict:
        """The update from policy version `step` to `step + 1`; logged, evaluated and checkpointed as `step + 1`."""
        if not self.driver:
            return self._train_only(step)
        cfg, timings, start = self.cfg, {}, time.perf_counter()
        batch, rewards = self._rollout(step, timings)
        group_ids = np.repeat(np.arange(cfg.sample.prompts_per_step), cfg.sample.group_size)
        adv, zero_std = compute_advantages(rewards["avg"], group_ids, global_std=cfg.train.global_std,
                                           clip=cfg.train.adv_clip, expected_group_size=cfg.sample.group_size)
        if cfg.rollout.sleep_while_training:
            t = time.perf_counter()
            freed = self.rollout.sleep()
            timings["sleep"] = time.perf_counter() - t
        t = time.perf_counter()
        train_batch = pad_text(batch.to_dict(), cfg.sample.max_sequence_length)
        train_batch.update(advantages=adv, noise_level=np.float32(cfg.sample.noise_level))
        train_batch = order_minibatches(train_batch, group_ids, cfg.train.num_mini_batches, cfg.seed, step)
        if self.processes > 1:
            train_batch = self._local_rows(train_batch)
        self.state, metrics = self.train_step(self.state, train_batch)
        metrics = jax.device_get(metrics)
        timings["train"] = time.perf_counter() - t
        if cfg.rollout.sleep_while_training:
            t = time.perf_counter()
            self.rollout.wake()
            timings["wake"] = time.perf_counter() - t
        t = time.perf_counter()
        bound = self._sync(step + 1)
        timings["sync"] = time.perf_counter() - t
        total = time.perf_counter() - start  # the step's wall time, phases and what lies between them
        out = {**metrics, "reward_mean": rewards["avg"].mean(), "reward_std": rewards["avg"].std(),
               "reward_errors": rewards["errors"], "zero_std_ratio": zero_std, "bound_modules": bound,
               "images_per_s": len(adv) / total, "time/step": total,
               **({"rollout_freed_gib": freed / 2 ** 30} if cfg.rollout.sleep_while_training else {}),
               **{f"reward/{k}": v.mean() for k, v in rewards.items() if k not in ("avg", "errors")},
               **{f"time/{k}": v for k, v in timings.items()}}
        return out

    def evaluate(self, step: int) -> float:
        cfg = self.cfg
        items = self.test_items[:cfg.eval.num_prompts]
        prompts = [it.prompt for it in items]
        batch = self.rollout.generate(prompts, 1, config_lib.sampling(cfg, eval_mode=True),
                                      np.arange(len(prompts)), cfg.sample.prompts_per_call)
        scores = self.pool.submit(batch.images, prompts).result()["avg"]
        image_grid(batch.images, [f"{r:.2f} {p}" for r, p in zip(scores, prompts)],
                   self.run_dir / "eval" / f"step_{step:06d}.png")
        return float(scores.mean())

    def run(self) -> dict:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        runlog = RunLog(self.run_dir, cfg.train.num_steps, self.start, cfg.log.tensorboard, cfg.log.progress) \
            if self.driver else None
        previous = {sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        history, profiler = [], StepProfiler.from_config(cfg, self.run_dir)
        try:
            for step in range(self.start, cfg.train.num_steps):
                profiler.begin(step + 1)
                metrics = self.train_one(step)
                profiler.end(step + 1, self.state)
                if (step + 1) % cfg.eval.every == 0 and self.driver:
                    metrics["eval_reward_mean"] = self.evaluate(step + 1)
                done = step + 1  # steps are counted as completed updates everywhere: metrics, eval, checkpoints
                history.append(runlog.log(done, metrics) if self.driver else {"step": done, **metrics})
                if self.processes > 1:  # every process stops after the same step
                    from jax.experimental import multihost_utils
                    flags = multihost_utils.process_allgather(np.int32(self.stop_requested))
                    self.stop_requested = bool(np.any(flags))
                last = step + 1 == cfg.train.num_steps
                if (step + 1) % cfg.checkpoint.every == 0 or last or self.stop_requested:
                    self.ckpt.save(step + 1, self.state, self._meta(step + 1))
                if self.stop_requested:
                    log.warning("stop requested: checkpoint at step %d written", step + 1)
                    break
            else:
                if self.processes == 1:
                    save_peft(self._model_with_state(), self.spec, self.run_dir / "lora_final")
                else:
                    lora = self._host_lora()
                    if self.driver:
                        save_peft(lora, self.spec, self.run_dir / "lora_final")
        finally:
            profiler.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if runlog is not None:
                runlog.close()
        return {"history": history, "state": self.state}

    def _model_with_state(self):
        nnx.update(self.model, self.state.lora)
        return self.model

    def _request_stop(self, signum, frame):
        log.warning("signal %d: finishing the current step, then checkpointing", signum)
        self.stop_requested = True

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self.rollout is not None:
            self.rollout.close()


if __name__ == "__main__":
    import sys

    from jaxflow import cli
    sys.exit(cli.main(Trainer))
