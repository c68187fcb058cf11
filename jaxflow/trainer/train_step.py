"""The train step (docs/design.md §2): `step(state, batch)` runs the algorithm the config resolves to
(`TrainConfig.policy`, `jaxflow.algorithms.registry`: a policy loss, FlowGRPO's ratio, the source of logp_old and a
row filter) over one rollout batch with two jitted, sharded functions. It calls the policy's components and
names none of them.

The batch is cut into num_mini_batches (M) mini-batches of whole prompt groups (`jaxflow.trainer.minibatches`: the caller
lays the groups out, mini-batch j = rows j, j + M, ...), one optimizer update each; num_inner_epochs repeats the
pass, each later epoch over the batch's rows shuffled anew (as flow_grpo does between inner epochs; seeded by
shuffle_seed, the step's first update count and the epoch, on the devices: `minibatches.epoch_order`). Where the
policy needs it (old_log_prob="recompute"), `old_log_probs` runs one forward-only pass with the pre-update LoRA (CFG
as in training) before the first update, over the rows that need it: the first update trains on the pre-update LoRA
itself, so its logp_old is its own logp under stop_gradient (exactly on-policy, the ratio exactly 1, what the pass
would compute up to rounding) and the pass covers the other mini-batches only (all of them from the second inner
epoch on). With a single update (M = 1, one epoch) there is no pass.

Each update (`_update`, compiled once: every mini-batch has the same shapes and its index is traced): functional
NNX (`graphdef, lora, frozen = nnx.split(model, LoRAParam, ...)`, `nnx.merge` inside the loss, gradients only for
the LoRA tree); the policy loss's gradient over the mini-batch (FlowGRPO's: for each micro-batch x each window step,
forward, SDE log-prob of the stored next latent, clipped objective (+ beta KL), gradient, accumulated with lax.scan,
each row's loss weighted 1 / (rows x W), the mini-batch's mean as flow_grpo's accumulation makes it, or with
drop_zero_advantage the mean over the rows whose advantage is not 0: `algorithms.flowgrpo_step`). Then ONE optimizer
update, skipped (state untouched, `skipped` = 1) when the loss or the gradient is not finite, or when the update
would make the LoRA or the optimizer state non-finite (checked inside the jit). The optimizer state covers the LoRA
tree only; the frozen base is an argument, never updated and never donated. num_micro_batches counts the
micro-batches of one update (of one mini-batch).

Micro-batch k holds rows k, k + m, k + 2m, ... of its mini-batch (m = num_micro_batches), so with the batch
sharded over the data devices every micro-batch is spread evenly over all of them. The sum of the gradients does
not depend on the grouping.
"""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxflow import families
from jaxflow.trainer import executable_cache, logp_gate, minibatches, phases
from jaxflow.trainer.compile_times import CompileTime
from jaxflow.algorithms.old_log_prob import old_log_probs
from jaxflow.nn.lora import LoRAParam
from jaxflow.algorithms.objective import WINDOW, Objective
from jaxflow.trainer.sharding import Layout
from jaxflow.trainer.step_config import TrainConfig, TrainState
from jaxflow.trainer.train_batch import TrainBatch, with_text_ids
from jaxflow_bridge.contract.batch import CONDITION_FIELDS, GUIDANCE_FIELDS, TEXT_IDS

log = logging.getLogger(__name__)


def advance_old(state: TrainState, first, *, config: TrainConfig) -> TrainState:
    """The old policy after a step, where the policy loss keeps one (`keeps_old`: DiffusionNFT's); `first` is the
    step's first update count. A step whose updates were all skipped leaves it as it was (no update applied, so
    neither its decay nor the old policy moves)."""
    moved = config.policy.loss.advanced(state.old, state.lora, state.step, config)
    applied = state.step > first
    return state.replace(old=jax.tree.map(lambda m, o: jnp.where(applied, m, o), moved, state.old))


def _apply_update(state: TrainState, grads, *, tx, config: TrainConfig) -> TrainState:
    updates, opt_state = tx.update(grads, state.opt_state, state.lora)
    lora = optax.apply_updates(state.lora, updates)
    ema = state.ema
    if ema is not None:  # flow_grpo's and NVlabs' warm-up: min(ema_decay, (1 + k) / (10 + k)), k counting this update
        k = state.step + 1.0
        decay = jnp.minimum(config.ema_decay, (1.0 + k) / (10.0 + k))
        ema = jax.tree.map(lambda e, p: decay * e + (1 - decay) * p, ema, lora)
    return TrainState(step=state.step + 1, lora=lora, opt_state=opt_state, ema=ema, old=state.old)


def _update(state: TrainState, frozen, batch, old, index, *, graphdef, config: TrainConfig, tx, layout,
            objective: Objective = WINDOW):
    """One optimizer update on mini-batch `index` of `batch` by the policy loss (`config.policy.loss.update`); `old`
    is the recompute pass's output or None."""
    mb = dict(minibatches.select(batch, config.num_mini_batches, index))
    grads, metrics, runs = config.policy.loss.update(state, frozen, mb, old, index, graphdef=graphdef, config=config,
                                                     layout=layout, objective=objective)
    return _finish(state, grads, metrics, tx=tx, config=config, runs=runs)


def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _checked_update(state: TrainState, grads, *, tx, config: TrainConfig) -> tuple[TrainState, jax.Array]:
    """(the updated state, True) when its LoRA and optimizer state are finite, else (`state` as it was, False)."""
    new = _apply_update(state, grads, tx=tx, config=config)
    ok = _all_finite((new.lora, new.opt_state))
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, state), ok


def _finish(state: TrainState, grads, metrics: dict, *, tx, config: TrainConfig, runs=None):
    """The optimizer update, skipped when the loss, the gradient or the updated LoRA or optimizer state is not
    finite (`skipped` = 1: the state is left as it was), or when no micro-batch `runs`."""
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
    ok = finite if runs is None else finite & jnp.any(runs)
    state, applied = jax.lax.cond(ok, functools.partial(_checked_update, tx=tx, config=config),
                                  lambda s, g: (s, jnp.array(False)), state, grads)
    skipped = ~finite | (ok & ~applied)
    return state, {**metrics, "grad_norm": grad_norm, "skipped": skipped.astype(jnp.int32)}


def prepare_batch(batch: TrainBatch, config: TrainConfig, batch_devices: int = 1) -> dict[str, np.ndarray]:
    """The per-sample host arrays the step consumes (`TrainBatch.per_sample`), checked, in the step's dtypes; a batch
    with `prompt_ids` (a family whose text is token ids) has them in place of the embeds."""
    loss = config.policy.loss
    fields = loss.batch_fields(config)
    if batch.prompt_ids is not None:
        fields = with_text_ids(fields)
    fields += tuple(k for k in CONDITION_FIELDS if getattr(batch, k) is not None)  # what the model reads beside text
    missing = [k for k in fields if getattr(batch, k) is None]
    if missing:
        hint = (" (guidance > 1 needs the negative prompt)" if set(missing) & set(GUIDANCE_FIELDS) else
                loss.missing_hint(missing))
        raise ValueError(f"train batch is missing {missing}{hint}")
    b = len(batch)
    multiple = config.num_mini_batches * config.num_micro_batches * batch_devices
    if b % multiple:
        raise ValueError(f"batch {b} is not a multiple of num_mini_batches x num_micro_batches x batch devices "
                         f"= {multiple}")
    out = batch.per_sample(fields)
    out["sigmas"] = out["sigmas"].astype(np.float32)
    for k in TEXT_IDS.values():
        if k in out:
            out[k] = out[k].astype(np.int32)
    return loss.prepare(out, batch, config)


def make_train_step(model: nnx.Module, config: TrainConfig, layout: Layout | None = None,
                    compiler_options: dict | None = None):
    """Returns (init_state, step) for a model with LoRA adapters.

    init_state() -> TrainState from the model's current LoRA params (copied; the model is left intact).
    step(state, batch) -> (state, metrics): `state` is donated (do not reuse it); `batch` is a `TrainBatch`, its
    mini-batches laid out by `minibatches.order_minibatches`. metrics: see
    `minibatches.combine_metrics`; its phases are timed under a `phases.recording()` (see
    `TrainStep.__call__`). With a `layout`, the frozen
    base, state and batch are placed by its rules and both functions run as jits with explicit in/out
    shardings; without one they run on the default device. `compiler_options` (XLA debug options, e.g.
    {"xla_gpu_enable_triton_gemm": False}) apply to these two jits only (config `train.xla_options`).
    The model's family picks the window log-prob (`Family.objective`, `jaxflow.algorithms.objective`), e.g. one
    that reads the batch's token ids with its own CFG (from `guidance`, `cfg_interval`, `cfg_renorm_min`), and
    refuses an algorithm it cannot train yet.
    An abstract model (its arrays ShapeDtypeStructs, `Family.abstract_unrolled`) gives a step to `compile` only:
    nothing is placed, and its `frozen` is set to the real weights (the same tree) before it runs.
    """
    objective, policy = families.of_model(model).objective(config), config.policy
    graphdef, lora, frozen = nnx.split(model, LoRAParam, ...)
    if not jax.tree.leaves(lora):
        raise ValueError("the model has no LoRA params: build it with a LoRASpec")
    tx = config.optimizer()
    abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves((lora, frozen)))

    def init(lora):
        lora = jax.tree.map(jnp.copy, lora)
        ema = jax.tree.map(jnp.copy, lora) if config.ema_decay is not None else None
        old = jax.tree.map(jnp.copy, lora) if policy.loss.keeps_old else None
        return TrainState(step=jnp.zeros((), jnp.int32), lora=lora, opt_state=tx.init(lora), ema=ema, old=old)

    update_fn = functools.partial(_update, graphdef=graphdef, config=config, tx=tx, layout=layout,
                                  objective=objective)
    old_fn = functools.partial(old_log_probs, graphdef, config=config, layout=layout, objective=objective)
    jit = functools.partial(jax.jit, compiler_options=compiler_options or None)
    advance_fn = functools.partial(advance_old, config=config)
    metrics_fn = functools.partial(step_metrics, config=config)
    if layout is None:
        init_jit, update, old_pass = jax.jit(init), jit(update_fn, donate_argnums=0), jit(old_fn)
        advance = jax.jit(advance_fn, donate_argnums=0)
        metrics_jit = jax.jit(metrics_fn)
        put, batch_devices = jax.device_put, 1  # jnp.asarray would compile a program per field
    else:
        state_sh = layout.tree_shardings(jax.eval_shape(init, lora))
        frozen_sh = layout.tree_shardings(frozen)
        if not abstract:
            frozen = jax.device_put(frozen, frozen_sh)
            lora = jax.device_put(lora, layout.tree_shardings(lora))
        init_jit = jax.jit(init, out_shardings=state_sh)
        rows, one = layout.batch_sharding, layout.replicated
        update = jit(update_fn, in_shardings=(state_sh, frozen_sh, rows, rows, one),
                         out_shardings=(state_sh, one), donate_argnums=0)
        old_pass = jit(old_fn, in_shardings=(state_sh.lora, frozen_sh, rows), out_shardings=rows)
        advance = jax.jit(advance_fn, in_shardings=(state_sh, one), out_shardings=state_sh, donate_argnums=0)
        metrics_jit = jax.jit(metrics_fn, out_shardings=one)
        put, batch_devices = layout.put_batch, layout.batch_devices // jax.process_count()
    indices = [put({"j": np.int32(j)})["j"] for j in range(config.num_mini_batches)]
    def reorder(tree, step, epoch):  # {"batch": ..., "old": ...} for inner epoch `epoch` >= 1
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(config.shuffle_seed), step), epoch)
        order = minibatches.epoch_order(key, tree["batch"]["advantages"], config.num_mini_batches,
                                        config.num_micro_batches, policy.filter.compacts)
        return jax.tree.map(lambda x: jnp.take(x, order, axis=0), tree)

    if config.num_inner_epochs == 1:
        reorder_jit = None
    elif layout is None:
        reorder_jit = jax.jit(reorder)
    else:
        reorder_jit = jax.jit(reorder, in_shardings=(rows, one, one), out_shardings=rows)
    step = TrainStep(config, update, old_pass, frozen, put, batch_devices, indices,
                     abstract_state=lambda: jax.eval_shape(init, lora), reorder=reorder_jit,
                     advance=advance if policy.loss.keeps_old else None, metrics=metrics_jit,
                     program=_program(config, graphdef, objective, layout, compiler_options))

    def init_state() -> TrainState:
        return init_jit(lora)

    return init_state, step


def _program(config: TrainConfig, graphdef, objective, layout: Layout | None, compiler_options) -> str | None:
    """What the step's jits close over (`executable_cache.describe`d, for its key): the step config, the model's
    graphdef, the objective, the layout with its devices and the XLA options; None (not cached, said once) where
    one of them has no stable description."""
    mesh = None if layout is None else (layout, [d.id for d in layout.mesh.devices.flat])
    try:
        return executable_cache.describe((config, executable_cache.describe_graphdef(graphdef), objective, mesh,
                                          compiler_options))
    except executable_cache.Unkeyable as exc:
        log.warning("executable cache: not used for this train step (%s)", exc)
        return None


class TrainStep:
    """`step(state, batch) -> (state, metrics)`, see `make_train_step`; `compile` builds its functions
    ahead of time for the batch's shapes and reports their memory (the first call otherwise compiles them)."""

    def __init__(self, config: TrainConfig, update, old_pass, frozen, put, batch_devices: int, indices: list,
                 abstract_state, metrics, reorder=None, advance=None, program: str | None = None):
        self.config, self._update, self._old_pass, self.frozen = config, update, old_pass, frozen
        self._reorder = reorder  # ({"batch", "old"}, step, epoch) -> the same rows reordered for a later epoch
        self._advance = advance  # state -> state with NFT's old policy moved toward the LoRA (`advance_old`)
        self._metrics = metrics  # (updates' metrics, old, the batch's log_probs and advantages) -> `step_metrics`
        self._put, self._batch_devices, self._indices = put, batch_devices, indices
        self.abstract_state = abstract_state  # () -> the TrainState's shapes and dtypes
        self.compile_times: list[CompileTime] = []  # `compile`'s, by function and stage
        self.program = program  # what the jits close over, for the executable cache's key (None: not cached)

    def compile(self, batch: dict, old) -> dict:
        """Compile the update (and the old-log-prob pass when it runs) for `batch` (ShapeDtypeStructs of the
        prepared batch; `old`: the pass's output's, or None) and use them from now on; returns
        {name: compiled} (their `memory_analysis()` says what they need on one device); `compile_times` then holds
        each one's seconds by stage (`compile_times.CompileTime`). Each is loaded from the executable cache where
        it holds it (no tracing), else traced and lowered, then compiled by XLA beside the others, in threads
        (`executable_cache.compile_cached`), and stored there."""
        state, index = self.abstract_state(), jax.ShapeDtypeStruct((), jnp.int32)
        calls = {"update": (self._update, state, self.frozen, batch, old, index)}
        if self.config.recompute_pass:
            calls["old_log_prob"] = (self._old_pass, state.lora, self.frozen, batch)
        timed = executable_cache.compile_cached(calls, self.program)
        out = {name: compiled for name, (compiled, _) in timed.items()}
        self.compile_times = [t for _, t in timed.values()]
        self._update = out["update"]
        self._old_pass = out.get("old_log_prob", self._old_pass)
        return out

    def __call__(self, state: TrainState, batch: TrainBatch, behavior=None) -> tuple[TrainState, dict]:
        """One step; `behavior`: the LoRA of the policy that sampled `batch` when it is not `state.lora` (one
        version behind, rollout.overlap): the recompute pass takes logp_old from it, so the ratio is against the
        sampling policy. Metrics add old_logp_diff_max, max |logp_old - the rollout's logp| over the batch, when the
        pass covers every row (0 up to the engine's rounding when logp_old is the sampling policy's), and
        logp_mismatch_* (`_sampled_gaps`, `logp_gate.mismatch_metrics`). Under a
        `phases.recording()` each phase waits for its device work and is timed: to_device (the host batch onto the
        devices: the trajectories' host round trip's way in), old_log_prob (when the pass runs) and update."""
        config, timed = self.config, phases.active()
        with phases.phase("to_device"):
            batch = self._put(prepare_batch(batch, config, self._batch_devices))
            if timed:
                jax.block_until_ready(batch)
        old = None
        if config.recompute_pass:
            with phases.phase("old_log_prob"):
                old = self._old_pass(state.lora if behavior is None else behavior, self.frozen, batch)
                if timed:
                    jax.block_until_ready(old)
        with phases.phase("update"):
            updates, first = [], jnp.copy(state.step)  # the state is donated: keep the step's first update count
            for epoch in range(config.num_inner_epochs):
                rows = {"batch": batch, **({} if old is None else {"old": old})}
                if epoch:
                    rows = self._reorder(rows, first, np.int32(epoch))
                for index in self._indices:
                    state, metrics = self._update(state, self.frozen, rows["batch"], rows.get("old"), index)
                    updates.append(metrics)
            if self._advance is not None:
                state = self._advance(state, first)
            if timed:
                jax.block_until_ready(state)
        scored = {k: batch[k] for k in ("log_probs", "advantages") if k in batch}
        return state, self._metrics(updates, old, scored)


def step_metrics(updates: list[dict], old, batch: dict, *, config: TrainConfig) -> dict:
    """The step's metrics from its `updates`' (`minibatches.combine_metrics`), the log-prob gate's logp_mismatch_*
    (`_sampled_gaps`, `logp_gate.mismatch_metrics`) and, where the recompute pass covers every row,
    old_logp_diff_max; `batch`: the step's log_probs and advantages. Jitted once (`TrainStep`): one program, where
    its reductions run eagerly compiled one program each at the first step."""
    first = updates[0].get("logp_gap")  # the first update's, on the pre-update LoRA
    metrics = minibatches.combine_metrics([{k: v for k, v in u.items() if k != "logp_gap"} for u in updates])
    gaps = None if first is None else _sampled_gaps(first, old, batch, config)
    if gaps is not None:
        metrics.update(logp_gate.mismatch_metrics(gaps))
    if old is not None and not config.pass_skips_first:
        diff = jnp.abs(old["log_probs"] - batch["log_probs"])
        metrics["old_logp_diff_max"] = jnp.max(config.policy.filter.logp_rows(diff, batch["advantages"]))
    return metrics


def _sampled_gaps(first, old, batch, config: TrainConfig):
    """|logp_trainer - logp_rollout| of the rows the trainer scored with the policy that sampled them (NaN where
    not measured), for the log-prob gate: the first update's rows (`first`, its pre-update LoRA is that policy
    unless the batch is one version old, rollout.overlap) and the recompute pass's (its LoRA is the sampling
    policy's); None where neither is (overlap without the pass)."""
    if old is None:
        return None if config.off_policy else first
    kept = config.policy.filter.logp_rows(jnp.ones_like(old["log_probs"]), batch["advantages"]) > 0
    gaps = jnp.where(kept, jnp.abs(old["log_probs"] - batch["log_probs"]), jnp.nan)
    if not config.pass_skips_first:  # the pass covers every row
        return gaps
    rows = gaps.shape[0]  # the pass left mini-batch 0 out: the first update scored it
    skipped = np.zeros((rows, 1), bool)
    skipped[minibatches.RowLayout(config.num_mini_batches).rows(rows, 0)] = True
    return jnp.concatenate([jnp.ravel(first), jnp.ravel(jnp.where(skipped, jnp.nan, gaps))])
