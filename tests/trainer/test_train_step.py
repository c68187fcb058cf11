"""The jitted FlowGRPO train step end to end with the JAX sampler on a tiny fp32 Qwen-Image DiT."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxflow.algorithms import flowgrpo
from jaxflow.nn.lora import LoRAParam
from jaxflow.families.qwen_image.transformer import QwenImageTransformer
from jaxflow.trainer.step_config import TrainConfig
from jaxflow.trainer.train_batch import TrainBatch
from jaxflow.algorithms.flowgrpo_step import accumulate_gradients
from jaxflow.trainer.train_step import make_train_step, prepare_batch
from jaxflow_bridge.contract import schedule
from tests.helpers import GRID, SEEDS, TINY, inputs
from tests.helpers_sampler import SamplerConfig, make_sampler

ADV = np.array([1.0, -1.0, 2.0, -0.5], np.float32)
PLAIN = TrainConfig(grid_hw=GRID, guidance=1.0, num_micro_batches=2, beta=0.04)  # the `plain` fixture's step


def _numpy(tree):
    return jax.tree.map(np.asarray, tree)


def _setup(model, guidance, **train_kw):
    config = SamplerConfig(grid_hw=GRID, num_steps=6, noise_level=1.2, guidance=guidance, window_size=2)
    traj = make_sampler(model, config)(inputs(guidance > 1), SEEDS)
    init_state, step = make_train_step(model, dataclasses.replace(PLAIN, guidance=guidance, **train_kw))
    return config, TrainBatch(**traj, advantages=ADV), init_state, step


@pytest.fixture(scope="module")
def plain(lora_model):
    return _setup(lora_model, 1.0)


@pytest.fixture(scope="module")
def cfg(lora_model):
    return _setup(lora_model, 4.0, ema_decay=0.9)


def test_sampler_trajectory(plain):
    config, batch, _, _ = plain
    starts = schedule.sample_windows(np.array(SEEDS), 2, (0, 5), 6)
    np.testing.assert_array_equal(batch.step_index, starts[:, None] + np.arange(2))
    assert batch.latents.shape == (4, 3, 4, 64) and batch.log_probs.shape == (4, 2)
    sigmas = config.sigmas()
    np.testing.assert_array_equal(batch.sigmas, sigmas)
    # E[log p] at sampling time = -1/2 - log(step std) - log(sqrt(2 pi)) (256 elements: +-0.05)
    s, s_next = sigmas[batch.step_index], sigmas[batch.step_index + 1]
    s_tilde = np.where(s == 1, sigmas[1], s)
    step_std = 1.2 * np.sqrt(s / (1 - s_tilde)) * np.sqrt(s - s_next)
    np.testing.assert_allclose(batch.log_probs, -0.5 - np.log(step_std) - 0.5 * math.log(2 * math.pi), atol=0.25)
    assert np.isfinite(np.asarray(batch.final_latents)).all()


@pytest.mark.slow
@pytest.mark.parametrize("setup", ["plain", "cfg"])
def test_recomputed_log_probs_match_rollout(setup, request):
    """On-policy (same weights, fp32): ratio == 1 and |logp - logp_rollout| ~ 0 at every window step."""
    _, batch, init_state, step = request.getfixturevalue(setup)
    state = init_state()
    before = _numpy(state)
    state, m = step(state, batch)
    assert int(m["skipped"]) == 0 and int(state.step) == 1
    assert abs(float(m["ratio_min"]) - 1) < 1e-6 and abs(float(m["ratio_max"]) - 1) < 1e-6
    assert m["logp_diff_max"].shape == (2,) and float(jnp.max(m["logp_diff_max"])) < 1e-6
    assert float(m["clipfrac"]) == 0 and float(m["approx_kl"]) < 1e-12
    assert float(m["kl"]) > 0 and np.isfinite(float(m["grad_norm"])) and float(m["grad_norm"]) > 0
    if setup == "cfg":  # EMA warm-up decay min(0.9, (1 + k) / (10 + k)) = 2/11 on the first update (k = 1)
        for e, old, new in zip(*(jax.tree.leaves(t) for t in (state.ema, before.lora, state.lora))):
            np.testing.assert_allclose(e, 2 / 11 * old + 9 / 11 * np.asarray(new), rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # a second compile of the step, for the padded negatives: ~40 s on 2 cores
def test_negatives_in_their_own_call_update_the_lora_as_one_batched_call(cfg):
    """The fixture's negatives (2 tokens) are shorter than its prompts (5): guided_velocity runs them as their own
    call. Padded to the prompts' length they run in one batched call: the same update to fp32 rounding."""
    _, batch, init_state, step = cfg
    pad = batch.prompt_embeds.shape[1] - batch.negative_prompt_embeds.shape[1]
    padded = dataclasses.replace(batch, negative_prompt_embeds=np.pad(batch.negative_prompt_embeds,
                                                                      ((0, 0), (0, pad), (0, 0))),
                                 negative_prompt_mask=np.pad(batch.negative_prompt_mask, ((0, 0), (0, pad))))
    before = _numpy(init_state().lora)
    (split, m_split), (batched, m_batched) = (step(init_state(), b) for b in (batch, padded))
    np.testing.assert_allclose(float(m_split["loss"]), float(m_batched["loss"]), rtol=1e-5)
    for s, b, old in zip(*(jax.tree.leaves(t) for t in (_numpy(split.lora), _numpy(batched.lora), before))):
        np.testing.assert_allclose(s - old, b - old, rtol=1e-4, atol=1e-7)
        assert np.abs(s - old).max() > 0


def _compiled(model, batch, config):
    """(init_state, step) with the step compiled ahead of time for `batch`'s shapes, as the memory plan does."""
    init_state, step = make_train_step(model, config)
    step.compile({k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in prepare_batch(batch, config).items()}, None)
    return init_state, step


def test_the_update_is_lowered_once_for_the_memory_plan_and_the_first_step(lora_model, plain):
    """The memory plan's compile (`TrainStep.compile`, timed by stage) is the executable the first step runs."""
    lowered, batch = [], plain[1]

    def listen(event, secs, **kw):  # every jit's lowering, whether the persistent cache then serves it or not
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration" and "_update" in kw.get("fun_name", ""):
            lowered.append(secs)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        init_state, step = _compiled(lora_model, batch, PLAIN)
        state, metrics = step(init_state(), batch)
        jax.block_until_ready(state)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert len(lowered) == 1 and int(metrics["skipped"]) == 0
    [update] = step.compile_times
    assert update.name == "update" and min(update.trace, update.lower, update.compile) > 0


@pytest.mark.slow  # its own update and recompute pass compile (about 10 s on 2 cores)
def test_the_first_step_compiles_its_metrics_as_one_program(lora_model, plain):
    """Past the memory plan's update and recompute pass, the first step compiles the copy of the step count (the
    state is donated) and the step's metrics (`step_metrics`, one jit): its reductions, the log-prob gate's
    percentiles and the pass's gaps ran eagerly before, one program each (26 on the tiny recipe)."""
    config = dataclasses.replace(PLAIN, num_mini_batches=2, num_micro_batches=1, old_log_prob="recompute")
    batch = plain[1]
    init_state, step = make_train_step(lora_model, config)
    shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in prepare_batch(batch, config).items()}
    step.compile(shapes, {"log_probs": shapes["log_probs"]})
    state, lowered = init_state(), []

    def listen(event, secs, **kw):  # each program lowered (whether or not a cache then serves its compile)
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered.append(kw.get("fun_name", ""))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert len(lowered) <= 2 and not {"_update", "old_log_probs"} & set(lowered), lowered
    assert int(metrics["logp_mismatch_rows"]) == batch.log_probs.size and "old_logp_diff_max" not in metrics
    assert float(metrics["logp_mismatch_max"]) < 1e-4 and int(metrics["skipped"]) == 0


def test_a_second_start_is_served_by_the_persistent_cache(lora_model, plain):
    """A step made anew (new jits, traced and lowered again, as a warm start does) gets XLA's part from the
    persistent cache (tests/conftest.py points the session at one) that the first compile wrote."""
    assert jax.config.jax_compilation_cache_dir, "tests/conftest.py sets JAX_COMPILATION_CACHE_DIR"
    minimum = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # written however quick the compile
    try:
        _, first = _compiled(lora_model, plain[1], PLAIN)
        _, again = _compiled(lora_model, plain[1], PLAIN)
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", minimum)
    assert [t.cached for t in again.compile_times] == [True], (first.compile_times, again.compile_times)


def test_only_lora_params_change(lora_model, plain):
    _, batch, init_state, step = plain
    base = _numpy(nnx.state(lora_model, nnx.Param))
    state = init_state()
    lora = _numpy(state.lora)
    state, _ = step(state, batch)
    for got, want in zip(jax.tree.leaves(nnx.state(lora_model, nnx.Param)), jax.tree.leaves(base)):
        np.testing.assert_array_equal(got, want)
    assert all(np.abs(np.asarray(a) - b).max() > 0 for a, b in zip(jax.tree.leaves(state.lora), jax.tree.leaves(lora)))
    # optimizer state: Adam moments shaped like the LoRA tree, nothing for the base
    adam = state.opt_state[1][0]
    assert jax.tree.structure(adam.mu) == jax.tree.structure(adam.nu) == jax.tree.structure(state.lora)
    big = [x.size for x in jax.tree.leaves(state.opt_state) if x.ndim]
    assert sum(big) == 2 * sum(x.size for x in jax.tree.leaves(state.lora))


def test_non_finite_loss_skips_the_update(plain):
    _, batch, init_state, step = plain
    state = init_state()
    before = _numpy(state)
    state, m = step(state, dataclasses.replace(batch, advantages=np.array([1.0, np.nan, 0.0, 0.0], np.float32)))
    assert int(m["skipped"]) == 1 and not np.isfinite(float(m["loss"]))
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(before)):
        np.testing.assert_array_equal(got, want)
    state, m = step(state, batch)
    assert int(m["skipped"]) == 0 and int(state.step) == 1


@pytest.mark.slow
def test_an_update_that_overflows_the_lora_is_skipped(lora_model, plain):
    """A learning rate past float32's range: the loss and the gradient are finite, the updated LoRA is not. The step
    reports the update skipped and leaves the LoRA and the optimizer state as they were."""
    _, batch, _, _ = plain
    init_state, step = make_train_step(lora_model, TrainConfig(grid_hw=GRID, guidance=1.0, num_micro_batches=2,
                                                               beta=0.04, learning_rate=1e39))
    state = init_state()
    before = _numpy(state)
    state, m = step(state, batch)
    assert int(m["skipped"]) == 1 and np.isfinite(float(m["loss"])) and np.isfinite(float(m["grad_norm"]))
    assert int(state.step) == 0
    for got, want in zip(jax.tree.leaves((state.lora, state.opt_state)), jax.tree.leaves((before.lora,
                                                                                         before.opt_state))):
        np.testing.assert_array_equal(got, want)


def test_gradient_matches_finite_differences(lora_model, plain):
    """Accumulated gradient (2 micro-batches x 2 window steps, KL on) vs a central difference of the mean
    loss along the top-6 gradient entries."""
    config = TrainConfig(guidance=1.0, grid_hw=GRID, num_micro_batches=2, beta=0.04, clip_range=10.0)  # no clipping
    graphdef, lora, frozen = nnx.split(lora_model, LoRAParam, ...)
    batch = jax.tree.map(jnp.asarray, prepare_batch(plain[1], config))

    @jax.jit
    def grads_and_loss(lora):
        grads, terms = accumulate_gradients(graphdef, lora, frozen, batch, config)
        return grads, flowgrpo.step_metrics(terms, clip_range=config.clip_range, beta=config.beta)["loss"]

    grads, _ = grads_and_loss(lora)
    flat_g = np.concatenate([np.asarray(g).ravel() for g in jax.tree.leaves(grads)])
    top = np.argsort(-np.abs(flat_g))[:6]
    direction = np.zeros_like(flat_g)
    direction[top] = flat_g[top] / np.linalg.norm(flat_g[top])
    leaves, treedef = jax.tree.flatten(lora)
    parts = np.split(direction, np.cumsum([x.size for x in leaves])[:-1])

    def loss_at(h):
        shifted = [x + h * p.reshape(x.shape) for x, p in zip(leaves, parts)]
        return float(grads_and_loss(jax.tree.unflatten(treedef, shifted))[1])

    h = 1e-2
    fd = (loss_at(h) - loss_at(-h)) / (2 * h)
    exact = float(direction @ flat_g)
    assert exact > 1e-3 and abs(fd - exact) <= 1e-3 * exact, (fd, exact)


def test_batch_validation():
    config = TrainConfig(grid_hw=GRID, guidance=4.0, num_micro_batches=2)
    batch = {"latents": np.zeros((4, 3, 4, 64), np.float32), "log_probs": np.zeros((4, 2), np.float32),
             "sigmas": np.linspace(1, 0, 7, dtype=np.float32), "step_index": np.zeros((4, 2), np.int32),
             "noise_level": 1.2, **inputs(False), "advantages": ADV}
    with pytest.raises(ValueError, match="negative"):
        prepare_batch(TrainBatch(**batch), config)
    out = prepare_batch(TrainBatch(**{**batch, **inputs(True)}), config)
    assert out["sigmas"].shape == (4, 7) and out["noise_level"].shape == (4,)
    with pytest.raises(ValueError, match="multiple"):
        prepare_batch(TrainBatch(**{**batch, **inputs(True)}), config, batch_devices=4)
    with pytest.raises(ValueError, match="sde_type"):
        TrainConfig(guidance=1.0, grid_hw=GRID, sde_type="ode")


def test_compiler_options_reach_the_step_jits(lora_model, plain):
    """train.xla_options go to the step's own jits (XLA rejects an unknown option when compiling them)."""
    _, traj, _, _ = plain
    init_state, step = make_train_step(lora_model, TrainConfig(guidance=1.0, grid_hw=GRID, num_micro_batches=2),
                                       compiler_options={"xla_jaxflow_no_such_option": True})
    with pytest.raises(Exception, match="xla_jaxflow_no_such_option"):
        step(init_state(), traj)


def test_model_without_lora_is_rejected():
    with pytest.raises(ValueError, match="no LoRA"):
        make_train_step(QwenImageTransformer(TINY, rngs=nnx.Rngs(0)), TrainConfig(guidance=1.0, grid_hw=GRID))


@pytest.mark.parametrize("mode", ["rollout", pytest.param("recompute", marks=pytest.mark.slow)])
def test_old_log_prob_source_under_a_rollout_offset(lora_model, mode):
    """A rollout log-prob offset (like the bf16 mismatch) moves the ratio when logp_old comes from the rollout;
    with 'recompute' the ratio stays exactly 1 (on-policy) while the mismatch metric still reports it."""
    _, batch, init_state, step = _setup(lora_model, 1.0, old_log_prob=mode)
    _, m = step(init_state(), dataclasses.replace(batch, log_probs=batch.log_probs + 3e-4))
    assert float(jnp.min(m["logp_diff_max"])) > 2.9e-4
    if mode == "recompute":
        assert float(m["ratio_min"]) == float(m["ratio_max"]) == 1.0
    else:
        assert float(m["ratio_max"]) < 1 - 2e-4
