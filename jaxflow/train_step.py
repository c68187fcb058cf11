"""The FlowGRPO train step (docs/design.md §2): `step(state, batch)` runs PPO over one rollout batch with two jitted,
sharded functions.

The batch is cut into num_mini_batches (M) mini-batches of whole prompt groups (`jaxflow.minibatches`: the caller
lays the groups out, mini-batch j = rows j, j + M, ...), one optimizer update each; num_inner_epochs repeats the
pass, each later epoch over the batch's rows shuffled anew (as flow_grpo does between inner epochs; seeded by
shuffle_seed, the step's first update count and the epoch, on the devices: `minibatches.epoch_order`). logp_old: old_log_prob="rollout" takes the engine's
log-probs; "recompute" runs `old_log_probs`, one forward-only pass with the pre-update LoRA (CFG as in training)
before the first update, as verl-omni's `compute_log_prob` does, over the rows that need it: the first update
trains on the pre-update LoRA itself, so its logp_old is its own logp under stop_gradient (exactly on-policy, the
ratio exactly 1, what the pass would compute up to rounding) and the pass covers the other mini-batches only (all of
them from the second inner epoch on). With a single update (M = 1, one epoch) there is no pass.

Each update (`_update`, compiled once: every mini-batch has the same shapes and its index is traced): functional
NNX (`graphdef, lora, frozen = nnx.split(model, LoRAParam, ...)`, `nnx.merge` inside the loss, gradients only for
the LoRA tree); for each micro-batch x each window step: forward, SDE log-prob of the stored next latent, clipped
objective (+ beta KL), gradient; accumulated with lax.scan, each loss divided by (num_micro_batches * W) as
flow_grpo does. Then ONE optimizer update, skipped (state untouched, `skipped` = 1) when the loss or the gradient
is not finite, or when the update would make the LoRA or the optimizer state non-finite (checked inside the jit).
The optimizer state covers the LoRA tree only; the frozen base is an argument, never updated and never donated.
num_micro_batches counts the micro-batches of one update (of one mini-batch).

Micro-batch k holds rows k, k + m, k + 2m, ... of its mini-batch (m = num_micro_batches), so with the batch
sharded over the data devices every micro-batch is spread evenly over all of them. The sum of the gradients does
not depend on the grouping.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxflow import minibatches, objectives, phases
from jaxflow.algorithms import flowgrpo, nft
from jaxflow.models.lora import LoRAParam
from jaxflow.objectives import QWEN_IMAGE, Objective
from jaxflow.sharding import Layout
from jaxflow.step_config import GUIDANCE_FIELDS, TEXT_IDS, TrainConfig, TrainState, with_text_ids
from jaxflow.train_batch import TrainBatch

NFT_SALT = 0x6E6674  # folded into the seed's key for NFT's timesteps and noise (apart from the epochs' shuffles)


def _window_loss(lora, frozen, step, scale, *, graphdef, config: TrainConfig, objective: Objective):
    model = nnx.merge(graphdef, lora, frozen)
    reject = float(np.log(config.rejection_threshold)) if config.old_log_prob == "rollout_corrected" else None
    terms = flowgrpo.window_step_terms(
        model, step, grid_hw=config.grid_hw, sde_type=config.sde_type, guidance=config.guidance,
        clip_range=config.clip_range, adv_clip=config.adv_clip, beta=config.beta, reject_log_ratio=reject,
        ratio_norm=config.ratio_norm, log_prob=functools.partial(objective.log_prob, config=config))
    return flowgrpo.window_loss(terms, config.beta) * scale, terms


def accumulate_gradients(graphdef, lora, frozen, batch: dict, config: TrainConfig, layout: Layout | None = None,
                         objective: Objective = QWEN_IMAGE):
    """Sum over micro-batches and window steps of grad(loss / (M * W)) wrt `lora`, and the per-sample terms
    stacked as (M, W, B/M), M = num_micro_batches. `batch` is per-sample (see `prepare_batch`). logp_old: the
    rollout's log_probs with old_log_prob="rollout" or "rollout_corrected" (which also rejects, see
    `flowgrpo.window_step_terms`), else batch["old_log_probs"] (B, W) if given, else the on-policy
    stop_gradient(logp).

    drop_zero_advantage: a micro-batch whose advantages are all 0 is not run (its rows' policy gradient is 0 and,
    with beta = 0, so is their loss) and M counts the others only, so the loss is the mean over the micro-batches
    that train, as flow_grpo's SD3 trainer trains only the samples it keeps (`minibatches.compact_zero_advantage`
    gathers the zero rows into whole micro-batches first). The terms then carry `mask` (M, W, B/M): False where a
    micro-batch did not run (its terms are zeros).

    `objective` (`jaxflow.objectives`): the model kind's window log-prob; its `context` runs once per micro-batch,
    outside the gradient (BAGEL: the frozen contexts' K/V, reused at every window step)."""
    m, w = config.num_micro_batches, batch["log_probs"].shape[1]
    if config.old_log_prob in ("rollout", "rollout_corrected"):
        batch = {**batch, "old_log_probs": batch["log_probs"]}
    flags = {k: batch[k] for k in ("old_on_policy",) if k in batch}  # scalars, not per sample
    batch = minibatches.micro_batches({k: v for k, v in batch.items() if k not in flags}, m)
    active = jnp.any(batch["advantages"] != 0, axis=1) if config.drop_zero_advantage else jnp.ones(m, bool)
    scale = 1.0 / (jnp.maximum(jnp.sum(active), 1) * w) if config.drop_zero_advantage else 1.0 / (m * w)
    grad_fn = jax.grad(functools.partial(_window_loss, graphdef=graphdef, config=config, objective=objective),
                       has_aux=True)

    def micro(grads, xs):
        mb, run = xs
        if layout is not None:
            mb = jax.lax.with_sharding_constraint(mb, layout.batch_sharding)
        per_step, shared = flowgrpo.window_steps(mb)

        def train(grads):
            ctx = objective.context(nnx.merge(graphdef, lora, frozen), shared, config)

            def window(grads, xs):
                g, terms = grad_fn(lora, frozen, {**ctx, **flags, **xs}, scale=scale)
                return jax.tree.map(jnp.add, grads, g), terms

            return jax.lax.scan(window, grads, per_step)

        if not config.drop_zero_advantage:
            return train(grads)
        shapes = jax.eval_shape(train, grads)[1]
        return jax.lax.cond(run, train, lambda g: (g, jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), shapes)),
                            grads)

    grads, terms = jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, lora), (batch, active))
    if config.drop_zero_advantage:
        terms["mask"] = jnp.broadcast_to(active[:, None, None], terms["ratio"].shape)
    return grads, terms


def advance_old(state: TrainState, *, config: TrainConfig) -> TrainState:
    """DiffusionNFT's old policy after a step (`nft.advanced`)."""
    return state.replace(old=nft.advanced(state.old, state.lora, state.step, config.nft_decay))


def old_log_probs(graphdef, lora, frozen, batch: dict, config: TrainConfig, layout: Layout | None = None,
                  objective: Objective = QWEN_IMAGE) -> dict:
    """{"log_probs": (B, W) float32 log-probs of the stored window steps under `lora`} and, with ratio_norm="guard",
    "means": (B, W, S, C) the SDE steps' means; forward only (true CFG as in training), in the updates'
    micro-batches: num_mini_batches x num_micro_batches of them, each the same rows in the same order as one
    micro-batch of an update; `objective` as in `accumulate_gradients`."""
    m, k = config.num_mini_batches, config.num_mini_batches * config.num_micro_batches
    # whole-batch micro-batch c holds mini-batch c % m's micro-batch c // m; mini-batch 0's are left out when the
    # first update uses its own logp (`pass_skips_first`)
    run = [c for c in range(k) if c % m or not config.pass_skips_first]

    def micro(carry, mb):
        if layout is not None:
            mb = jax.lax.with_sharding_constraint(mb, layout.batch_sharding)
        per_step, shared = flowgrpo.window_steps(mb)

        def forward():
            ctx = objective.context(nnx.merge(graphdef, lora, frozen), shared, config)

            def window(carry, xs):
                model = nnx.merge(graphdef, lora, frozen)
                mean, logp, _ = objective.log_prob(model, {**ctx, **xs}, config)
                out = {"log_probs": logp.astype(jnp.float32)}
                if config.ratio_norm == "guard":
                    out["means"] = mean.astype(jnp.float32)
                return carry, out

            return jax.lax.scan(window, carry, per_step)[1]

        if not config.drop_zero_advantage:
            return carry, forward()
        # a micro-batch the updates skip (advantages all 0) needs no logp_old
        shapes = jax.eval_shape(forward)
        return carry, jax.lax.cond(jnp.any(mb["advantages"] != 0), forward,
                                   lambda: jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), shapes))

    mbs = jax.tree.map(lambda x: x[np.asarray(run)], minibatches.micro_batches(batch, k))
    parts = jax.lax.scan(micro, None, mbs)[1]  # each (len(run), W, B/k, ...)

    def whole(part):  # row t*k + c of the batch is [c, :, t] of the (k, W, B/k, ...) stack
        full = jnp.zeros((k, *part.shape[1:]), part.dtype).at[np.asarray(run)].set(part)
        full = jnp.moveaxis(full, 2, 0)  # (B/k, k, W, ...)
        return full.reshape(-1, *full.shape[2:])

    return jax.tree.map(whole, parts)


def _apply_update(state: TrainState, grads, *, tx, config: TrainConfig) -> TrainState:
    updates, opt_state = tx.update(grads, state.opt_state, state.lora)
    lora = optax.apply_updates(state.lora, updates)
    ema = state.ema
    if ema is not None:  # flow_grpo's warm-up: decay min(ema_decay, (1 + k) / (10 + k))
        decay = jnp.minimum(config.ema_decay, (1.0 + state.step) / (10.0 + state.step))
        ema = jax.tree.map(lambda e, p: decay * e + (1 - decay) * p, ema, lora)
    return TrainState(step=state.step + 1, lora=lora, opt_state=opt_state, ema=ema, old=state.old)


def _update(state: TrainState, frozen, batch, old, index, *, graphdef, config: TrainConfig, tx, layout,
            objective: Objective = QWEN_IMAGE):
    """One optimizer update on mini-batch `index` of `batch`; `old` is the recompute pass's output or None."""
    mb = dict(minibatches.select(batch, config.num_mini_batches, index))
    if config.nft:  # the timesteps and noise: a function of the seed and the update count (a resume draws the same)
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(config.shuffle_seed), NFT_SALT), state.step)
        grads, terms = nft.gradients(graphdef, state.lora, state.old, frozen, mb, key, config, layout)
        return _finish(state, grads, nft.step_metrics(terms, config.beta), tx=tx, config=config)
    if old is not None:
        old = minibatches.select(old, config.num_mini_batches, index)
        mb["old_log_probs"] = old["log_probs"]
        if "means" in old:
            mb["old_means"] = old["means"]
        if config.pass_skips_first:  # the pass left mini-batch 0 out: the first update is on-policy
            mb["old_on_policy"] = index == 0
    grads, terms = accumulate_gradients(graphdef, state.lora, frozen, mb, config, layout, objective)
    metrics = flowgrpo.step_metrics(terms, clip_range=config.clip_range, beta=config.beta)
    runs = None
    if config.drop_zero_advantage:  # nothing to train on: no optimizer update (flow_grpo would have no batch)
        runs = jnp.any(terms["mask"], axis=(1, 2))
        metrics.update(micro_skipped=jnp.sum(~runs).astype(jnp.int32),
                       empty_updates=(~jnp.any(runs)).astype(jnp.int32))
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
    with `prompt_ids` (BAGEL) has token ids in place of the embeds."""
    fields = config.batch_fields
    if batch.prompt_ids is not None:
        fields = with_text_ids(fields)
    missing = [k for k in fields if getattr(batch, k) is None]
    if missing:
        hint = (" (guidance > 1 needs the negative prompt)" if set(missing) & set(GUIDANCE_FIELDS) else
                " (the rollout keeps them with keep_final: config.sampling does for train.algorithm='nft')"
                if "final_latents" in missing else "")
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
    if config.nft:
        return out
    w = batch.log_probs.shape[1]
    latents, step_index = batch.latents.shape, batch.step_index.shape
    if latents[:2] != (b, w + 1) or step_index != (b, w):
        raise ValueError(f"latents {latents} / step_index {step_index} do not match log_probs {(b, w)}: "
                         f"expected (B, W+1, S, C) / (B, W)")
    out["noise_level"] = out["noise_level"].astype(np.float32)
    out["step_index"] = out["step_index"].astype(np.int32)
    return out


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
    The model's kind picks the window log-prob (`objectives.for_model`): a `BagelModel` reads the batch's token
    ids (BAGEL's text CFG from `guidance`, `cfg_interval`, `cfg_renorm_min`) and refuses DiffusionNFT.
    """
    objective = objectives.for_model(model, config)
    graphdef, lora, frozen = nnx.split(model, LoRAParam, ...)
    if not jax.tree.leaves(lora):
        raise ValueError("the model has no LoRA params: build it with a LoRASpec")
    tx = config.optimizer()

    def init(lora):
        lora = jax.tree.map(jnp.copy, lora)
        ema = jax.tree.map(jnp.copy, lora) if config.ema_decay is not None else None
        old = jax.tree.map(jnp.copy, lora) if config.nft else None
        return TrainState(step=jnp.zeros((), jnp.int32), lora=lora, opt_state=tx.init(lora), ema=ema, old=old)

    update_fn = functools.partial(_update, graphdef=graphdef, config=config, tx=tx, layout=layout,
                                  objective=objective)
    old_fn = functools.partial(old_log_probs, graphdef, config=config, layout=layout, objective=objective)
    jit = functools.partial(jax.jit, compiler_options=compiler_options or None)
    advance_fn = functools.partial(advance_old, config=config)
    if layout is None:
        init_jit, update, old_pass = jax.jit(init), jit(update_fn, donate_argnums=0), jit(old_fn)
        advance = jax.jit(advance_fn, donate_argnums=0)
        put, batch_devices = (lambda b: jax.tree.map(jnp.asarray, b)), 1
    else:
        state_sh = layout.tree_shardings(jax.eval_shape(init, lora))
        frozen_sh = layout.tree_shardings(frozen)
        frozen = jax.device_put(frozen, frozen_sh)
        lora = jax.device_put(lora, layout.tree_shardings(lora))
        init_jit = jax.jit(init, out_shardings=state_sh)
        rows, one = layout.batch_sharding, layout.replicated
        update = jit(update_fn, in_shardings=(state_sh, frozen_sh, rows, rows, one),
                         out_shardings=(state_sh, one), donate_argnums=0)
        old_pass = jit(old_fn, in_shardings=(state_sh.lora, frozen_sh, rows), out_shardings=rows)
        advance = jax.jit(advance_fn, in_shardings=(state_sh,), out_shardings=state_sh, donate_argnums=0)
        put, batch_devices = layout.put_batch, layout.batch_devices // jax.process_count()
    indices = [put({"j": np.int32(j)})["j"] for j in range(config.num_mini_batches)]
    def reorder(tree, step, epoch):  # {"batch": ..., "old": ...} for inner epoch `epoch` >= 1
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(config.shuffle_seed), step), epoch)
        order = minibatches.epoch_order(key, tree["batch"]["advantages"], config.num_mini_batches,
                                        config.num_micro_batches, config.drop_zero_advantage)
        return jax.tree.map(lambda x: jnp.take(x, order, axis=0), tree)

    if config.num_inner_epochs == 1:
        reorder_jit = None
    elif layout is None:
        reorder_jit = jax.jit(reorder)
    else:
        reorder_jit = jax.jit(reorder, in_shardings=(rows, one, one), out_shardings=rows)
    step = TrainStep(config, update, old_pass, frozen, put, batch_devices, indices,
                     abstract_state=lambda: jax.eval_shape(init, lora), reorder=reorder_jit,
                     advance=advance if config.nft else None)

    def init_state() -> TrainState:
        return init_jit(lora)

    return init_state, step


class TrainStep:
    """`step(state, batch) -> (state, metrics)`, see `make_train_step`; `compile` builds its functions
    ahead of time for the batch's shapes and reports their memory (the first call otherwise compiles them)."""

    def __init__(self, config: TrainConfig, update, old_pass, frozen, put, batch_devices: int, indices: list,
                 abstract_state, reorder=None, advance=None):
        self.config, self._update, self._old_pass, self.frozen = config, update, old_pass, frozen
        self._reorder = reorder  # ({"batch", "old"}, step, epoch) -> the same rows reordered for a later epoch
        self._advance = advance  # state -> state with NFT's old policy moved toward the LoRA (`advance_old`)
        self._put, self._batch_devices, self._indices = put, batch_devices, indices
        self.abstract_state = abstract_state  # () -> the TrainState's shapes and dtypes

    def compile(self, batch: dict, old) -> dict:
        """Compile the update (and the old-log-prob pass when it runs) for `batch` (ShapeDtypeStructs of the
        prepared batch; `old`: the pass's output's, or None) and use them from now on; returns
        {name: compiled} (their `memory_analysis()` says what they need on one device)."""
        state, index = self.abstract_state(), jax.ShapeDtypeStruct((), jnp.int32)
        out = {"update": self._update.lower(state, self.frozen, batch, old, index).compile()}
        if self.config.recompute_pass:
            out["old_log_prob"] = self._old_pass.lower(state.lora, self.frozen, batch).compile()
            self._old_pass = out["old_log_prob"]
        self._update = out["update"]
        return out

    def __call__(self, state: TrainState, batch: TrainBatch, behavior=None) -> tuple[TrainState, dict]:
        """One step; `behavior`: the LoRA of the policy that sampled `batch` when it is not `state.lora` (one
        version behind, rollout.overlap): the recompute pass takes logp_old from it, so the ratio is against the
        sampling policy. Metrics add old_logp_diff_max, max |logp_old - the rollout's logp| over the batch, when the
        pass covers every row (0 up to the engine's rounding when logp_old is the sampling policy's). Under a
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
                state = self._advance(state)
            if timed:
                jax.block_until_ready(state)
        metrics = minibatches.combine_metrics(updates)
        if old is not None and not config.pass_skips_first:
            diff = jnp.abs(old["log_probs"] - batch["log_probs"])
            if config.drop_zero_advantage:  # rows of skipped micro-batches have no logp_old
                diff = jnp.where(batch["advantages"][:, None] != 0, diff, 0.0)
            metrics["old_logp_diff_max"] = jnp.max(diff)
        return state, metrics
