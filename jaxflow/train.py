"""FlowGRPO training: `python -m jaxflow.train --config configs/tiny_ocr.py [--config.a.b=v] [--resume]`.

The loop (docs/design.md §2) composes process 0's `Driver` (jaxflow/run/driver.py: prompts, rollout, rewards,
advantages -> the train batch) and every process's `Learner` (jaxflow/trainer/learner.py: the jitted, sharded step on its
rows, checkpoints, the LoRA). Per step: experience -> train step -> LoRA sync to the rollout (version acked,
bound-module count checked) -> metrics, logged by process 0. Evaluation (ODE sampling on held-out prompts, a PNG
grid) every `eval.every` steps; orbax checkpoints every `checkpoint.every` steps and on SIGINT/SIGTERM (every
process stops after the same step); the final LoRA is exported in PEFT format to `run_dir/lora_final`, also when
`train.max_minutes` ends the run early (its last step is the one expected to end within that many minutes of the
trainer's start, model loading included). With `eval.rewards` the evals also score gold rewards; with
`eval.best_metric` the best eval's policy is kept in `run_dir/lora_best`, and with `eval.stop_after` the run ends
early, normally, when that gold metric falls while the training reward rises (jaxflow/run/gold.py). With
`train.ema_decay` the eval and the export use the LoRA's EMA, as flow_grpo's do. A step that skipped an update (a
non-finite loss, gradient or LoRA) writes no checkpoint; more than `train.max_skipped_steps` of them in a row, or
one at the last step, stop the run with `divergence.Diverged`, nothing of the diverged state written. The log-prob
gate (`trainer.logp_gate`: train.logp_gate, train.logp_gate_steps) stops a run whose trainer no longer scores the
rollout's samples as the engine drew them, before the step's checkpoint.

Multi-host (jax.distributed, one trainer process per host; see `maybe_initialize_distributed`): process 0 alone
holds the driver; every process holds a learner and checkpoints; `run_dir` must be on a filesystem they share.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from pathlib import Path

import jax
import numpy as np
from ml_collections import ConfigDict

from jaxflow.config import derived
from jaxflow.config import validation as config_lib
from jaxflow.config.machine import resolve_layout, share_set
from jaxflow.config.sections import RunConfig
from jaxflow.trainer import compile_times, memory, phases
from jaxflow.run import gold
from jaxflow.run import run_dir as run_dir_lib
from jaxflow.trainer.checkpoint import config_json
from jaxflow.run.data import GroupSampler, load_prompts
from jaxflow.trainer.divergence import SkipStreak
from jaxflow.trainer.logp_gate import Gate
from jaxflow.run.driver import Driver
from jaxflow.trainer.learner import Learner, run_plan
from jaxflow.run.metrics_log import RunLog
from jaxflow.run.profiling import StepProfiler
from jaxflow.run.wandb_log import WandbLog
from jaxflow.trainer.sharding import Layout, maybe_initialize_distributed

log = logging.getLogger("jaxflow.train")
WAIT = "waiting for the rollout engines"  # the start-up phase in which the trainer waits for engines in Ray actors


def sleep_warning(cfg: RunConfig) -> str | None:
    """The rule for `rollout.sleep_while_training`: a sleeping engine frees its GPU memory for the trainer, which can
    use it only if JAX allocates as it goes. With a fixed pool (XLA_PYTHON_CLIENT_PREALLOCATE, as README says for
    one GPU) nothing takes it: the sleep costs time (a few seconds a step, BENCHMARKS.md) and buys nothing."""
    if not cfg.rollout.sleep_while_training or jax.default_backend() != "gpu":
        return None
    if os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true").lower() in ("false", "0"):
        return None
    return ("rollout.sleep_while_training=True with JAX holding a fixed pool (XLA_PYTHON_CLIENT_PREALLOCATE): the "
            "memory the engine frees cannot be used by the trainer; set --config.rollout.sleep_while_training=False")


CPU_OVERRIDES = ("--config.rollout.device=cpu --config.rollout.num_gpus=0 --config.rollout.engine=diffusers "
                 "--config.rollout.dtype=float32 --config.model.dtype=float32 --config.model.param_dtype=float32 "
                 "--config.model.remat=save_matmuls --config.train.xla_options={}")


def check_backend(cfg: RunConfig) -> None:
    """A rollout on a GPU with JAX on the CPU is a broken install or environment, not a choice: refuse it in one
    line that names both ways out (a CUDA jaxlib, or every override a CPU run of this config needs)."""
    backend = jax.default_backend()
    if str(cfg.rollout.device).startswith("cuda") and backend == "cpu":
        raise config_lib.UserError(
            "JAX found no GPU but rollout.device is cuda: install a CUDA jaxlib (pip install 'jax[cuda13]') and do "
            "not set both XLA_CLIENT_MEM_FRACTION and XLA_PYTHON_CLIENT_MEM_FRACTION; or run everything on the CPU "
            f"with {CPU_OVERRIDES} (a full-size model on a CPU is very slow: configs/tiny_ocr.py is the CPU run)")


SHARING = {"colocated": "the colocated engine", "in_process": "the in-process engine"}  # engines on JAX's GPUs


def check_share(cfg: RunConfig, devices=None) -> None:
    """Where the plan set JAX's share of each GPU (`share_set`) and an engine shares the GPUs, JAX's pool on
    each local device (default `jax.local_devices()`) must be that share: a JAX started before it took its default
    75%, and the engine would die minutes later (`memory.check_share`, exit 1). A share the user set is theirs."""
    share = share_set()
    if share is None or cfg.rollout.layout not in SHARING:
        return
    memory.check_share(share.fraction, share.card_bytes, jax.local_devices() if devices is None else devices,
                       SHARING[cfg.rollout.layout])


class Trainer:
    """Holds the run's pieces; `run()` drives the loop. Build with `Trainer(config, resume)`: `config` is the
    validation stage's RunConfig (the command line validated it), or a ConfigDict validated here."""

    def __init__(self, config: RunConfig | ConfigDict, resume: bool = False):
        self.started = time.monotonic()  # train.max_minutes counts from here
        self.startup, self._phase_began = {}, None  # seconds per start-up phase, in order
        self.rollout_load_s = None  # the rollout engines' start, from their launch (`_start`)
        self.engine_start = None  # where the slowest engine's own start went, as it reports it (EngineStart)
        self.startup_detail = {}  # a phase's breakdown, for the start-up line: the memory plan's compiles by stage
        cfg = config if isinstance(config, RunConfig) else config_lib.validate(config)
        self.cfg = cfg = resolve_layout(cfg, resume=resume)[0]  # rollout.layout='auto' (the command line resolved it)
        self._begin("checks")
        maybe_initialize_distributed()
        run_dir_lib.check_shared(Path(cfg.run_dir))
        check_backend(cfg)
        check_share(cfg)  # before any engine is launched
        config_lib.check_layout(cfg, jax.default_backend(), jax.device_count())
        warning = sleep_warning(cfg)
        if warning:
            log.warning("%s", warning)
        self.processes, first = jax.process_count(), jax.process_index() == 0
        if first and not resume:  # never write into a previous run (the command line can --overwrite it)
            run_dir_lib.check_fresh(Path(cfg.run_dir))
        s = cfg.sample
        if (s.prompts_per_step * s.group_size) % self.processes:
            raise config_lib.UserError(f"the train batch (sample.prompts_per_step x sample.group_size = "
                                       f"{s.prompts_per_step * s.group_size}) must divide by the {self.processes} "
                                       f"JAX processes: each feeds an equal share of its rows")
        self.run_dir = Path(cfg.run_dir)
        self._begin("prompts and rewards")
        folder = config_lib.model_folder(cfg)
        # every 'auto' resolved once (jaxflow/config/plan.py): what the driver and the learner read
        self.plan = run_plan(cfg, folder, Layout.create(derived.sharding_config(cfg)))
        train_items = load_prompts(cfg.data.train, config_lib.needs_target(cfg))
        self.sampler = GroupSampler(len(train_items), s.prompts_per_step, s.group_size, cfg.seed)
        self.driver = Driver(cfg, folder, train_items, self.sampler, self.plan) if first else None
        try:  # a failed start closes what it launched: engines in Ray actors load from their launch on
            self._start(folder, resume)
        except BaseException:
            if self.driver:
                self.driver.close()
            raise
        self._begin(None)
        self.stop_requested = False

    def _start(self, folder: Path, resume: bool) -> None:
        """The trainer's model, the memory plan (the step compiled and checked, train.num_micro_batches='auto'
        fitted: the plan that the driver and the learner read from then on), the train state (`Learner.begin`,
        fresh or with `resume` its checkpoint's: the start step and the sampler's position), the rollout's start and
        the first LoRA sync. Engines that load in processes of their own (Ray actors) are launched first, as soon as
        the plan exists, and load beside all of it (on memory JAX's pool already holds), waited for just before the
        sync; an in-process engine starts after the memory check, so that a step which cannot fit stops with no
        engine loaded, and the train state is made after it. With model.unroll_upgrade the unrolled step starts
        compiling in the background then (`Learner.start_upgrade`), its seconds not the start-up's.
        `rollout_load_s`: the engines' whole start."""
        apart = self.driver is not None and self.driver.loads_apart
        self._begin("trainer's model")
        if apart:
            launched = time.monotonic()
            self.driver.launch_rollout()
        self.learner = Learner(self.cfg, folder, self.plan)
        self._begin("memory plan")
        autotuned = compile_times.autotune_results()  # before the step's compiles add to it
        try:  # before anything is written: a step that cannot fit stops here
            self.memory_summary = self.learner.check_memory()
        except MemoryError as exc:
            raise config_lib.UserError(str(exc)) from None
        self.startup_detail["memory plan"] = compile_times.summary(self.learner.compile_times, autotuned)
        self.plan = self.learner.plan
        if self.driver:
            self.driver.plan = self.plan
        if self.driver and not apart:
            self._begin("rollout start")
            launched = time.monotonic()
            self.driver.launch_rollout()
            self._join_rollout(launched)
        self._begin("train state")
        meta = self.learner.begin(resume)  # nothing of it comes from the engines
        self.learner.start_upgrade()  # model.unroll_upgrade: the unrolled step compiles beside what follows
        self.start = meta["step"] if meta else 0
        if meta:
            self.sampler.load_state_dict(meta["sampler"])
        if apart:
            self._begin(WAIT)
            self._join_rollout(launched)
        self._begin("first LoRA sync")
        with phases.recording() as seconds:
            self._sync(self.start)  # the rollout serves exactly the trainer's policy before the first step
        if self.driver:
            self.startup_detail["first LoRA sync"] = self.driver.sync_summary(seconds)
        e = self.cfg.eval  # the best eval so far by eval.best_metric and the early-stop rule, on process 0
        self.gold = gold.GoldWatch.resume(e.best_metric, e.stop_after, self.run_dir / "lora_best") \
            if e.best_metric and self.driver else None

    def _join_rollout(self, launched: float) -> None:
        """Wait for the rollout's engines (launched at `launched`, monotonic) and check them against the trainer's
        model (`Driver.join_rollout`)."""
        self.engine_start = self.driver.join_rollout(self.learner.model, self.processes)
        self.rollout_load_s = time.monotonic() - launched
        if self.engine_start is not None and not self.driver.loads_apart:  # in process: its own phase's detail
            self.startup_detail["rollout start"] = self.engine_start.summary()

    def _begin(self, phase: str | None) -> None:
        """End the running start-up phase (its seconds go to `startup`) and begin `phase` (None: start-up is over),
        announced by process 0 as one line `start-up: PHASE ...` with log.progress: a start can take minutes."""
        now = time.monotonic()
        if self._phase_began is not None:
            name, began = self._phase_began
            self.startup[name] = now - began
        self._phase_began = (phase, now) if phase else None
        if phase and self.cfg.log.progress and run_dir_lib.first_process():
            print(f"start-up: {phase} ...", flush=True)

    def startup_line(self, before: dict[str, float] | None = None) -> str:
        """Where the start went: "start-up 312 s: Ray 3 s, checks 2 s, trainer's model 95 s, ..." (the first step,
        which compiles, comes after; `before`: phases that ran before the trainer was built, in order and counted in
        the total, e.g. the command line's start of Ray), the memory plan's compiles by stage ("memory plan 91 s
        (trace 20 s, lower 30 s, compile 41 s; 2 of 2 compiles from the cache, ..., XLA's autotune cache held 0
        results)": tracing and lowering are redone at every start, XLA's compile, the wall time of the step's programs
        compiled at once, a warm start's cache serves; "load N s" where the executable cache served them; the
        autotune results an earlier run left, which a compile neither cache serves still reads,
        `compile_times.summary`), and the engines' whole start where part of it ran beside the trainer's own phases
        (engines in Ray actors), naming those phases; an engine that reports its own start's parts (`EngineStart`:
        vllm_omni) has them named beside its phase or its whole start."""
        detail = {name: f" ({text})" for name, text in self.startup_detail.items() if text}
        phases = {**(before or {}), **self.startup}
        line = (f"start-up {sum(phases.values()):.0f} s: "
                + ", ".join(f"{name} {sec:.0f} s{detail.get(name, '')}" for name, sec in phases.items()))
        if self.rollout_load_s is None or WAIT not in self.startup:
            return line
        names = list(self.startup)  # engines in Ray actors load from the trainer's model's start to the wait
        *rest, last = names[names.index("trainer's model"):names.index(WAIT)]
        beside = self.rollout_load_s - self.startup[WAIT]
        if beside > 0.5:
            where = f"the {', the '.join(rest)} and the {last}" if rest else f"the {last}"
            parts = f" ({self.engine_start.summary()})" if self.engine_start is not None else ""
            line += (f"; the rollout engines started in {self.rollout_load_s:.0f} s{parts}, {beside:.0f} s of it "
                     f"beside {where}")
        return line

    def _sync(self, version: int, which: str | None = None) -> int | None:
        """The rollout serves the train state's tree `which` (default: the one it samples with, `Learner.sampling`)
        as policy `version` (every process joins the gather)."""
        lora = self.learner.whole_lora(which or self.learner.sampling)
        return self.driver.serve(lora, version) if self.driver else None

    def _evaluate(self, step: int) -> dict | None:
        """Held-out rewards (`Driver.evaluate`'s metrics; None off process 0) of the policy the run exports (every process joins): where it is not the one that samples
        (train.ema_decay: its EMA, as flow_grpo evaluates; train.algorithm='nft': the LoRA, not the old policy) the
        rollout serves it for the eval and the sampling one again after it."""
        other = self.learner.exported != self.learner.sampling
        if other:
            self._sync(step, self.learner.exported)
        scores = self.driver.evaluate(step) if self.driver else None
        if other:
            self._sync(step)
        return scores

    def _keep_best(self, step: int) -> None:
        """Export the policy of eval `step`, the best so far by eval.best_metric, to run_dir/lora_best (every
        process joins the gather): written beside it, then swapped in whole (`gold.publish`)."""
        dest = self.run_dir / "lora_best"
        first = run_dir_lib.first_process()
        tmp = gold.staging(dest) if first else dest.with_name(dest.name + ".partial")
        self.learner.export_lora(tmp)
        if first:
            gold.publish(tmp, dest, self.gold.note())
            log.info("step %d: the best eval so far by %s: its adapter is in %s", step, self.gold.metric, dest)

    def _meta(self, step: int) -> dict:
        return {"step": step, "sampler": self.sampler.state_dict(), "config": config_json(self.cfg)}

    def train_one(self, step: int) -> dict:
        """The update from policy version `step` to `step + 1`; logged, evaluated and checkpointed as `step + 1`.
        Process 0 collects the experience (rollout, rewards, advantages); every process trains on its rows of it."""
        with phases.recording() as seconds, phases.phase("step"):
            experience, metrics, bound, freed = self._train_one(step)
        metrics.update({f"time/{k}": v for k, v in seconds.items()})
        if experience is not None:
            metrics.update(experience.metrics(bound, seconds["step"], freed), sync_failures=self.driver.sync_failures,
                           **self.driver.sync_checks)
        return metrics

    def _train_one(self, step: int):
        """The step's work, phase by phase: (experience or None, the learner's metrics, bound modules, freed bytes)."""
        experience = self.driver.experience(step) if self.driver else None
        # rollout.overlap: every step after the first of this process's run trains on a batch that the previous
        # policy sampled while the previous step trained (a resumed run's first batch is sampled anew)
        behavior = step - 1 if self.cfg.rollout.overlap and step > self.start else step
        if experience is not None and experience.policy_version != behavior:
            raise RuntimeError(f"step {step}: the batch was sampled by policy {experience.policy_version}, "
                               f"expected {behavior}")
        if self.driver and self.cfg.rollout.overlap and step + 1 < self.cfg.train.num_steps:
            self.driver.prefetch(step + 1)
        with self.driver.idle() if self.driver else contextlib.nullcontext({}) as slept:
            with phases.phase("train"):
                metrics = self.learner.train(experience.batch if experience else None, version=step,
                                             behavior=behavior)
        metrics["staleness"] = step - behavior
        with phases.phase("sync"):
            bound = self._sync(step + 1)
        metrics["micro_batch"] = self.learner.micro_batch_size()
        stats = jax.local_devices()[0].memory_stats()
        if stats and "peak_bytes_in_use" in stats:  # JAX's own peak on its first device (a GPU), not the engine's
            metrics["jax_peak_gib"] = stats["peak_bytes_in_use"] / 2 ** 30
        return experience, metrics, bound, slept.get("freed_bytes")

    def run(self) -> dict:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        wandb = WandbLog(self.run_dir, self.start, cfg.log.wandb_project, cfg.log.wandb_mode,
                         json.loads(config_json(cfg))) if self.driver and cfg.log.wandb else None
        runlog = RunLog(self.run_dir, cfg.train.num_steps, self.start, cfg.log.tensorboard, cfg.log.progress,
                        wandb) if self.driver else None
        previous = {sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        history, profiler = [], StepProfiler.from_config(cfg, self.run_dir)
        limit = cfg.train.max_minutes * 60 or float("inf")
        stopped, early, skips = False, None, SkipStreak(cfg.train.max_skipped_steps)
        gate = Gate(cfg.train.logp_gate, cfg.train.logp_gate_steps, first_step=self.start + 1)
        saved = self.start if self.start else None  # the newest checkpoint's step
        try:
            for step in range(self.start, cfg.train.num_steps):
                began = time.monotonic()
                profiler.begin(step + 1)
                metrics = self.train_one(step)
                profiler.end(step + 1, self.learner.state)
                every = cfg.eval.every  # 0: no eval; else every `every` steps and the final policy
                best = False  # this eval is the best so far by eval.best_metric (process 0 decides)
                if every and ((step + 1) % every == 0 or step + 1 == cfg.train.num_steps):
                    scores = self._evaluate(step + 1)
                    if self.driver:
                        metrics.update(scores)
                    if self.gold:
                        verdict = self.gold.record(step + 1, scores[gold.gold_key(self.gold.metric)],
                                                   scores[gold.TRAIN_KEY])
                        best, early = verdict.best, verdict.stop
                done = step + 1  # steps are counted as completed updates everywhere: metrics, eval, checkpoints
                history.append(runlog.log(done, metrics) if self.driver else {"step": done, **metrics})
                now = time.monotonic()  # out of time: the next step, as long as this one, would end past the limit
                out_of_time = now + (now - began) - self.started > limit
                skipped = bool(metrics.get("skipped", 0))
                if self.processes > 1:  # every process stops after the same step
                    from jax.experimental import multihost_utils
                    flags = multihost_utils.process_allgather(np.int32([self.stop_requested, out_of_time, skipped,
                                                                        best, early is not None]))
                    self.stop_requested, out_of_time, skipped, best, gold_stop = (bool(x) for x in np.any(flags, 0))
                    early = early or ("eval.stop_after" if gold_stop else None)
                if best and cfg.eval.best_metric:
                    self._keep_best(done)
                skips.record(done, skipped)
                last = step + 1 == cfg.train.num_steps or out_of_time or early is not None
                if skips.over or (last and skipped):  # nothing of the diverged state is written
                    raise skips.error(self.run_dir, saved, ended=not skips.over)
                gate.record(done, metrics)  # the same figures on every process (the step's replicated metrics)
                if gate.tripped:  # the step is logged; its checkpoint and lora_final are not written
                    raise gate.error(self.run_dir, saved)
                if (step + 1) % cfg.checkpoint.every == 0 or last or self.stop_requested:
                    if skipped:  # no checkpoint of a state whose loss was not finite (`jaxflow.trainer.divergence`)
                        log.warning("step %d skipped an update: its checkpoint is not written", done)
                    else:
                        self.learner.save(done, self._meta(done))
                        saved = done
                if self.stop_requested:
                    log.warning("stop requested: the newest checkpoint is step %s", saved)
                    stopped = True
                    break
                if early is not None:  # a normal end: checkpointed above, lora_final below
                    break
                if out_of_time:
                    log.warning("train.max_minutes=%g: the run ends after step %d (of %d)", cfg.train.max_minutes,
                                step + 1, cfg.train.num_steps)
                    break
            if not stopped:
                self.learner.export_lora(self.run_dir / "lora_final")
        finally:
            profiler.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if runlog is not None:
                runlog.close()
        return {"history": history, "state": self.learner.state, "stopped": stopped, "checkpoint": saved,
                "early_stop": early}

    def _request_stop(self, signum, frame):
        """The first SIGINT/SIGTERM: finish the step, checkpoint, stop. A second: stop at once (KeyboardInterrupt;
        the checkpoints are left as they are)."""
        if self.stop_requested:
            raise KeyboardInterrupt
        log.warning("signal %d: finishing the current step, then checkpointing (again to stop at once)", signum)
        self.stop_requested = True

    def close(self) -> None:
        if self.driver:
            self.driver.close()


if __name__ == "__main__":
    import sys

    from jaxflow.run import cli
    sys.exit(cli.main(Trainer))
