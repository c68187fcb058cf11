"""Every process's side of the run (docs/design.md §2): the model, the train state and the jitted, sharded step,
checkpoints, and the LoRA gathered whole for the rollout and the final export.

Multi-process (one per host): process 0's train batch reaches every process (`share_batch`), each feeds its own
contiguous rows to the step (`local_rows`; the global batch is their concatenation in process order), so the step
is the single-process step. All processes checkpoint and restore together (orbax); `run_dir` must be on a
filesystem they share.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxflow.config import derived
from jaxflow.config import plan as plan_lib
from jaxflow.config import validation as config_lib
from jaxflow.config.plan import RunPlan
from jaxflow.config.sections import RunConfig
from jaxflow.nn.lora import LoRAParam
from jaxflow.trainer import compile_times, memory
from jaxflow.trainer.checkpoint import Checkpointer
from jaxflow.trainer.divergence import check_finite
from jaxflow.trainer.minibatches import RowLayout
from jaxflow import families
from jaxflow.nn.lora_gemm import on_hopper
from jaxflow.trainer.sharding import Layout
from jaxflow.trainer.train_batch import TrainBatch
from jaxflow.trainer.train_step import make_train_step
from jaxflow.trainer.unroll_upgrade import KEEPS_SCAN, Background

log = logging.getLogger("jaxflow.train")


def build_model(cfg: RunConfig, folder: Path, spec, layout: Layout, plan: RunPlan | None = None):
    """The trainer's model of the config's family (jaxflow/families/) from `folder`, with the plan's ModelOptions
    (the plan made here where none is given): base weights from it, or drawn from `seed` with `model.init=random`;
    with unrolled blocks (model.scan_unroll >= the blocks) each block's frozen weights are arrays of their own."""
    plan = plan or run_plan(cfg, folder, layout)
    model = families.of(cfg).build_model(cfg, folder, spec, plan.model, sharding=layout.sharding_fn, seed=cfg.seed)
    _split_rows(model, layout)
    return model


def _split_rows(model, layout: Layout) -> None:
    """With model.lora_gemm=pallas under data parallelism each device runs the fused kernel on its own rows."""
    if model.opts.lora_gemm == "pallas" and layout.batch_devices > 1:
        model.split_rows(layout.mesh, layout.batch_axes)


def run_plan(cfg: RunConfig, folder: Path, layout: Layout) -> RunPlan:
    """The validated config's plan (jaxflow/config/plan.py) on this process's JAX, for the batch split of `layout`."""
    return plan_lib.make_plan(cfg, folder, backend=jax.default_backend(), devices=jax.device_count(),
                              batch_devices=layout.batch_devices, on_hopper=on_hopper(),
                              processes=jax.process_count())


_DESC_BYTES = 1 << 14  # the broadcast description of a train batch (keys, shapes, dtypes) as JSON


def share_batch(batch: dict | None) -> dict[str, np.ndarray]:
    """Process 0's per-sample `batch` (host arrays), on every process: a fixed-size description (keys, shapes,
    dtypes) is broadcast first, so the other processes (which pass None) can build same-sized zero buffers, then the
    arrays themselves as raw bytes (any dtype, bfloat16 and int64 included, arrives bit-exact)."""
    import ml_dtypes
    from jax.experimental import multihost_utils
    desc = np.zeros(_DESC_BYTES, np.uint8)
    if batch is not None:
        text = json.dumps({k: [list(v.shape), v.dtype.name] for k, v in batch.items()}).encode()
        if len(text) > _DESC_BYTES:
            raise ValueError(f"train batch description is {len(text)} bytes > {_DESC_BYTES}")
        desc[:len(text)] = np.frombuffer(text, np.uint8)
    desc = np.asarray(multihost_utils.broadcast_one_to_all(desc))
    spec = json.loads(desc.tobytes().rstrip(b"\0").decode())
    dtypes = {k: np.dtype(getattr(ml_dtypes, d)) if hasattr(ml_dtypes, d) else np.dtype(d)
              for k, (_, d) in spec.items()}
    if batch is not None:
        payload = {k: np.ascontiguousarray(batch[k]).reshape(-1).view(np.uint8) for k in spec}
    else:
        payload = {k: np.zeros(int(np.prod(shape)) * dtypes[k].itemsize, np.uint8) for k, (shape, _) in spec.items()}
    payload = multihost_utils.broadcast_one_to_all(payload)
    return {k: np.asarray(payload[k]).view(dtypes[k]).reshape(spec[k][0]) for k in spec}


def local_rows(batch: TrainBatch | None) -> TrainBatch:
    """Process 0's train `batch` (None on the other processes), made per-sample, on every process, cut to this
    process's contiguous share of rows."""
    full = share_batch(None if batch is None else batch.per_sample())
    mine = RowLayout().process_rows(len(full["advantages"]), jax.process_index(), jax.process_count())
    return TrainBatch(**{k: v[mine] for k, v in full.items()})


def _layout(tree) -> tuple:
    """A tree's structure and its leaves' shapes and dtypes."""
    return jax.tree.structure(tree), [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]


class Learner:
    """Built on every process from the config and the model folder; `begin` then makes the train state."""

    def __init__(self, cfg: RunConfig, folder: Path, plan: RunPlan | None = None):
        """`plan`: the run's (the Trainer's); made here where none is given."""
        self.cfg, self.processes = cfg, jax.process_count()
        self.layout = Layout.create(derived.sharding_config(cfg))
        self.plan = plan or run_plan(cfg, folder, self.layout)
        self.spec = derived.lora_spec(cfg)
        self.family = families.of(cfg)
        try:
            self.grid = self.family.grid_hw(folder, cfg)
        except ValueError as exc:
            raise config_lib.UserError(str(exc)) from None
        self.model = build_model(cfg, folder, self.spec, self.layout, self.plan)
        o = self.model.opts
        log.info("trainer model: %s compute, %s storage, matmul precision %s, attention %s", o.dtype, o.param_dtype,
                 o.precision, self.model.impl)
        self.folder = folder
        self._init_state, self._step = self._make_step(self.plan.num_micro_batches)
        self.compile_times = []  # every ahead-of-time compile's seconds by stage (trials included; `_compiled`)
        self.ckpt = self.state = None
        self._previous = None  # (version, LoRA copy) of the policy one step back, for rollout.overlap
        self._upgrade = None  # the unrolled step building in the background (`start_upgrade`), until the swap
        self.upgraded = False  # the unrolled step runs (model.unroll_upgrade)
        self.upgrade_compile_times = []  # its compile's seconds by stage, apart from the start-up's
        self._calls = 0  # train steps run by this learner

    def _make_step(self, num_micro_batches: int):
        """(init_state, step) of the train step with `num_micro_batches` an update."""
        return make_train_step(self.model, derived.train_config(self.cfg, self.grid, num_micro_batches),
                               self.layout, dict(self.plan.xla_options))

    def memory_plans(self, num_micro_batches: int | None = None) -> tuple[list, int]:
        """(per-function `memory.StepMemory`, bytes of their arguments already on a device) of the step compiled
        for the run's batch shapes: the learner's own step (whose executables the loop then runs), or with
        `num_micro_batches` a trial step made and compiled for that count alone."""
        step = self._step if num_micro_batches is None else self._make_step(num_micro_batches)[1]
        return self._compiled(step)

    def _compiled(self, step) -> tuple[list, int]:
        """`memory_plans` of `step`, compiled now for the run's batch shapes (it runs these executables)."""
        plans = self._compile(step)
        self.compile_times += step.compile_times
        return plans, memory.device_bytes(step.frozen)

    def batch_shapes(self, tc) -> tuple[dict, dict | None]:
        """The run's train batch as the step with TrainConfig `tc` takes it, and its old-log-prob pass's output
        (`memory.abstract_batch`): ShapeDtypeStructs, per sample."""
        cfg = self.cfg
        text, negative_text = derived.text_tokens(cfg)
        return memory.abstract_batch(
            batch=cfg.sample.prompts_per_step * cfg.sample.group_size, window=cfg.sample.window_size,
            num_steps=cfg.sample.num_steps, seq=self.grid[0] * self.grid[1], text=text, negative_text=negative_text,
            embed_dtype=derived.embed_dtype(cfg), guided=tc.guided, recompute=tc.recompute_pass,
            means=tc.policy.ratio.old_means, nft=not tc.policy.loss.log_probs, **self.family.batch_shape(self.model))

    def _compile(self, step) -> list:
        """Compile `step` for the run's batch shapes; its functions' `memory.StepMemory`."""
        return [memory.StepMemory.of(name, c) for name, c in step.compile(*self.batch_shapes(step.config)).items()]

    def micro_batch_size(self, num_micro_batches: int | None = None) -> int:
        """Samples in one micro-batch on one device (the plan's, or with `num_micro_batches` an update)."""
        return plan_lib.micro_batch_size(self.cfg, self.layout.batch_devices,
                                         num_micro_batches or self.plan.num_micro_batches)

    def check_memory(self) -> str | None:
        """Compile the step for the run's batch shapes (the loop then uses these executables) and check that it fits
        JAX's pool beside the frozen weights (jaxflow/trainer/memory.py); returns the summary line. MemoryError naming the
        knobs if it does not fit; None where the backend keeps no statistics (the CPU). With
        train.num_micro_batches='auto' the micro-batch is first fitted to the compiled analysis (`_fit_auto`; the
        plan then says so). Call before `begin`: the train state is counted as still to be made."""
        plans, resident = self.memory_plans()
        stats = memory.pool()
        if stats is None:
            return None
        if self.cfg.train.num_micro_batches == "auto":
            plans = self._fit_auto(plans, resident, stats[0] - stats[1])
        what = f"{self.micro_batch_size()} samples per micro-batch per device, model.remat={self.cfg.model.remat}"
        return memory.check_fits(plans, resident, *stats, what)

    def _fit_auto(self, plans: list, resident: int, free: int) -> list:
        """train.num_micro_batches='auto' from the compiled step's memory analysis: the largest micro-batch (a
        divisor of a device's share of the mini-batch) whose update fits `free` bytes, tried from the largest down,
        each predicted by the planner's memory model scaled to the compiled need at the planned size
        (`planner.UpdateMemory.from_analysis`) and compiled to confirm. Adopts it (its compiled step, the plan
        resized) and returns its plans; the plan's own where none fits (`check_fits` then names the knobs)."""
        need = lambda ps: max(p.need(resident) for p in ps)  # noqa: E731
        planned, per_device = self.plan.micro_batch, plan_lib.per_update(self.cfg) // self.layout.batch_devices
        model = self._update_memory(need(plans), planned)
        sizes = [m for m in range(per_device, 0, -1) if per_device % m == 0]
        if need(plans) <= free:  # larger ones that the scaled model admits
            tries = [m for m in sizes if m > planned and model is not None and model.need(m) <= free]
        else:  # smaller ones, but those it rules out
            tries = [m for m in sizes if m < planned and (model is None or model.need(m) <= free)]
        for m in tries:
            init, step = self._make_step(per_device // m)
            trial, _ = self._compiled(step)
            if need(trial) <= free:
                self._init_state, self._step = init, step
                self.plan = self.plan.resized(per_device // m, m, f"auto: the largest that the compiled step's "
                                                                  f"memory analysis fits in JAX's pool (planned "
                                                                  f"{planned}: {self.plan.micro_batch_why})")
                return trial
        return plans

    def _update_memory(self, need: int, micro_batch: int):
        """The planner's memory model (`planner.UpdateMemory`) scaled to the compiled `need` at `micro_batch`; None
        where the folder has no weights to size it from."""
        from jaxflow.config import machine
        from jaxflow.config import planner
        try:
            counts = planner.UpdateMemory.from_counts(machine.model_sizes(self.cfg, self.folder), planner.load_table())
        except config_lib.UserError:
            return None
        return planner.UpdateMemory.from_analysis(0, need, micro_batch, counts)

    def begin(self, resume: bool) -> dict | None:
        """Open the checkpoint folder and make the train state: fresh, or with `resume` the newest checkpoint's that
        restores, whose metadata is returned."""
        self.ckpt = Checkpointer(Path(self.cfg.run_dir) / "checkpoints", self.cfg.checkpoint.keep)
        self.state = self._init_state()
        if not resume:
            return None
        self.state, meta = self.ckpt.restore(self.state)
        return meta

    def start_upgrade(self) -> None:
        """Where the plan upgrades (model.unroll_upgrade, `RunPlan.upgrade`), start building the unrolled step in a
        background thread (`unroll_upgrade.Background`): made from the model as it will run, abstract
        (`Family.abstract_unrolled`), compiled for the run's batch shapes, and checked against JAX's pool as it is
        now, beside the frozen weights and the train state (on a backend without statistics, the CPU, not
        checked). Call after `begin`; `train` swaps to it at the first step boundary after it is ready."""
        target = self.plan.upgrade
        if target is None or self._upgrade is not None or self.upgraded:
            return
        abstract = self.family.abstract_unrolled(self.model, target.model)
        _split_rows(abstract, self.layout)
        stats, resident = memory.pool(), memory.device_bytes((self._step.frozen, self.state))
        what = f"{self.micro_batch_size()} samples per micro-batch per device, unrolled blocks"
        config = derived.train_config(self.cfg, self.grid, self.plan.num_micro_batches)

        def build():
            step = make_train_step(abstract, config, self.layout, dict(target.xla_options))[1]
            plans = self._compile(step)
            if stats is not None:
                memory.check_fits(plans, resident, *stats, what)
            return step

        self._upgrade = Background(build)

    def wait_upgrade(self) -> None:
        """Block until the background build (`start_upgrade`), if any, is done: the next `train` swaps (for a caller
        that wants the swap at a known step)."""
        if self._upgrade is not None:
            self._upgrade.wait()

    def _swap(self, step: int) -> None:
        """The background build is done: from training step `step` (1-based) on, the unrolled step runs, the
        model's frozen block weights unstacked (the old step released first: one stack more at the peak); the
        train state keeps its layout. A build that failed, or frozen weights that the host has no room to hold while
        they are unstacked, leave the scanned step, with one warning."""
        built, self._upgrade = self._upgrade, None
        if built.error is not None:
            log.warning(built.problem())
            return
        new = built.result
        if _layout(self.state) != _layout(new.abstract_state()):  # the LoRA, optimizer, EMA and old policy
            raise RuntimeError("upgrade: the unrolled step's train state differs from the running one's")
        _, _, frozen = nnx.split(self.model, LoRAParam, ...)
        short = memory.host_shortfall(sum(x.nbytes for x in jax.tree.leaves(frozen) if isinstance(x, jax.Array)))
        if short is not None:  # checked before anything is freed: the scanned step keeps running on its weights
            log.warning(f"upgrade: the swap holds the frozen weights on the host, {short}; {KEEPS_SCAN}")
            return
        self._step = None  # its frozen stacks go as the model unstacks them
        began = time.monotonic()
        self.family.unroll(self.model, self.plan.upgrade.model)
        unstacked = time.monotonic() - began
        _split_rows(self.model, self.layout)
        _, _, frozen = nnx.split(self.model, LoRAParam, ...)
        if jax.tree.structure(frozen) != jax.tree.structure(new.frozen):
            raise RuntimeError("upgrade: the unrolled model's frozen weights differ from the compiled step's")
        new.frozen = frozen
        self._step, self.upgraded = new, True
        self.upgrade_compile_times = new.compile_times
        log.warning("upgrade: unrolled blocks compiled in %.0f s beside %s; step %d on, the weights unstacked in "
                    "%.1f s (%s)", built.seconds, built.steps(), step, unstacked,
                    compile_times.summary(new.compile_times))

    def train(self, batch: TrainBatch | None, version: int | None = None, behavior: int | None = None) -> dict:
        """One train step on process 0's `batch` (None on the other processes) from policy `version` to the next;
        returns its metrics (host). `behavior`: the version that sampled the batch, `version` or (rollout.overlap)
        `version - 1`, whose LoRA the recompute pass then uses (a copy kept from the step before, only when that pass
        runs); anything older is refused. Its phases (`jaxflow.trainer.phases`): to_device (the batch onto the devices),
        old_log_prob (the recompute pass, when on) and update."""
        step = (self._calls if version is None else version) + 1
        self._calls += 1
        if self._upgrade is not None and self._upgrade.ready:
            self._swap(step)
        if self._upgrade is not None:
            self._upgrade.beside.append(step)
        if self.processes > 1:
            batch = local_rows(batch)
        lora, config = None, self._step.config
        if config.recompute_pass and behavior is not None and behavior != version:
            if self._previous is None or self._previous[0] != behavior:
                raise RuntimeError(f"the batch was sampled by policy {behavior}; the trainer is at {version} and "
                                   f"keeps only {None if self._previous is None else self._previous[0]}")
            lora = self._previous[1]
        # the current LoRA, for the next step's batch (the state is donated); only the recompute pass reads it
        if config.off_policy and config.recompute_pass:
            self._previous = (version, jax.tree.map(jnp.copy, self.state.lora))
        self.state, metrics = self._step(self.state, batch, behavior=lora)
        metrics = jax.device_get(metrics)
        if self.plan.upgrade is not None:  # which steps ran the unrolled blocks
            metrics["upgraded"] = int(self.upgraded)
        return metrics

    def save(self, step: int, meta: dict) -> None:
        self.ckpt.save(step, self.state, meta)

    @property
    def has_ema(self) -> bool:
        """Whether the train state keeps an EMA of the LoRA (train.ema_decay > 0)."""
        return self.state.ema is not None

    @property
    def exported(self) -> str:
        """The train state's tree the run exports and evaluates: "ema" when it keeps one (flow_grpo saves its
        EMA), else "lora"."""
        return "ema" if self.has_ema else "lora"

    @property
    def sampling(self) -> str:
        """The train state's tree the rollout samples with: "old" for DiffusionNFT (its old policy), else "lora"."""
        return "old" if self.state.old is not None else "lora"

    def whole_lora(self, which: str = "lora"):
        """The train state's tree `which` ("lora", "ema" or "old") whole on this process: its own arrays in one
        process; else host arrays gathered from every process, a collective all must join (the LoRA may be
        sharded over devices of several hosts)."""
        lora = getattr(self.state, which)
        if lora is None:
            raise ValueError(f"the train state keeps no {which!r} LoRA: "
                             + ("set train.ema_decay > 0" if which == "ema" else "set train.algorithm='nft'"))
        if self.processes == 1:
            return lora
        from jax.experimental import multihost_utils
        return jax.tree.map(np.asarray, multihost_utils.process_allgather(lora, tiled=True))

    def export_lora(self, directory: Path) -> None:
        """The run's policy in PEFT format to `directory`, written by process 0 (every process joins the gather):
        the EMA of the LoRA when the state keeps one (flow_grpo saves its EMA), else the LoRA. `Diverged` (nothing
        written, on every process) when one of its values is not finite."""
        lora = self.whole_lora(self.exported)
        check_finite(lora, f"the trained {self.exported}", directory)
        if jax.process_index() == 0:
            self.family.save_peft(lora, self.spec, directory)
