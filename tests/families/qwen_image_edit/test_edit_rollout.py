"""The edit rollout on the diffusers engine's pipeline (tiny Qwen-Image-Edit, float32, CPU): conditioning made once per
prompt group, the trajectory's reference latents, and the JAX objective's log-prob of its window steps."""
import types

import jax.numpy as jnp
import numpy as np
import pytest

from jaxflow.algorithms import flowgrpo
from jaxflow.families.qwen_image.loading import load_transformer
from jaxflow.families.qwen_image_edit.objective import EDIT_WINDOW
from jaxflow.families.qwen_image_edit.transformer import QwenImageEditTransformer
from jaxflow_bridge.families.qwen_image_edit.diffusers_pipeline import RolloutPipeline, tiny_folder
from jaxflow_bridge.rollout.sampling import SamplingParams

SIZE, N = 32, 3  # the tiny VAE: 8 pixels a packed token
PARAMS = SamplingParams(height=SIZE, width=SIZE, num_inference_steps=4, true_cfg_scale=2.0, sde_window_size=2,
                        sde_window_range=(0, 2), noise_level=0.8)


@pytest.fixture(scope="module")
def pipe():
    return RolloutPipeline.from_pretrained(tiny_folder(), "float32", "cpu")


def sources(count=2, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (1, SIZE, SIZE, 3), dtype=np.uint8) for _ in range(count)]


def counted(monkeypatch, module, name):
    """Record the batch size of every call of `module.name`."""
    calls, original = [], getattr(module, name)

    def spy(*args, **kw):
        first = args[0] if args else next(iter(kw.values()))
        calls.append(len(first))
        return original(*args, **kw)

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.fixture(scope="module")
def batch(pipe):
    return pipe.generate(["make it red", "add a sign"], N, PARAMS, seeds=11, references=sources())


def test_a_group_shares_one_conditioning_made_once_per_prompt(pipe, monkeypatch):
    encodes = counted(monkeypatch, pipe.text_encoder, "forward")
    vae = counted(monkeypatch, pipe.vae, "encode")
    out = pipe.generate(["make it red", "add a sign"], N, PARAMS, seeds=3, references=sources())
    assert encodes == [4]  # one VL pass: 2 instructions + their 2 negatives, not 2 * N samples
    assert vae == [2]  # one VAE pass over the 2 reference images
    refs = out.reference_latents
    assert refs.shape == (2 * N, 1, (SIZE // 8) ** 2, 64) and refs.dtype == np.float32
    assert all(np.array_equal(refs[i], refs[i - i % N]) for i in range(2 * N))
    assert not np.array_equal(refs[0], refs[N])
    # the negative prompt sees each prompt's image too: per prompt, not one for all
    neg = out.negative_prompt_embeds
    assert not np.array_equal(neg[0], neg[N])


def test_the_reference_image_conditions_the_samples(pipe, batch):
    other = pipe.generate(["make it red", "add a sign"], N, PARAMS, seeds=11, references=sources(seed=1))
    assert not np.allclose(other.latents[:, -1], batch.latents[:, -1])


def test_references_are_checked_before_a_model_runs(pipe):
    with pytest.raises(ValueError, match="one reference image array per prompt"):
        pipe.generate(["a"], 1, PARAMS, references=None)
    with pytest.raises(ValueError, match=r"uint8 \(R, 32, 32, 3\)"):
        pipe.generate(["a"], 1, PARAMS, references=[np.zeros((1, 16, 16, 3), np.uint8)])


def test_jax_log_prob_matches_the_rollouts(batch):
    """The learner's edit objective on the trajectory (reference latents from the batch, true CFG) recomputes the
    rollout's log-probs: float32, the same model and SDE step on both sides."""
    model = load_transformer(tiny_folder() / "transformer", model_type=QwenImageEditTransformer)
    b = len(batch)
    mb = {"latents": batch.latents, "sigmas": np.broadcast_to(batch.sigmas, (b, len(batch.sigmas))),
          "step_index": batch.step_index, "noise_level": np.full(b, PARAMS.noise_level, np.float32),
          "prompt_embeds": batch.prompt_embeds, "prompt_mask": batch.prompt_mask,
          "negative_prompt_embeds": batch.negative_prompt_embeds, "negative_prompt_mask": batch.negative_prompt_mask,
          "reference_latents": batch.reference_latents, "advantages": np.zeros(b, np.float32)}
    per_step, shared = flowgrpo.window_steps({k: jnp.asarray(v) for k, v in mb.items()})
    assert "reference_latents" in shared
    config = types.SimpleNamespace(grid_hw=(SIZE // 8, SIZE // 8), sde_type="sde", guidance=PARAMS.true_cfg_scale)
    for k in range(batch.log_probs.shape[1]):
        tr = {**{name: v[k] for name, v in per_step.items()}, **shared}
        _, logp, _ = EDIT_WINDOW.log_prob(model, tr, config)
        np.testing.assert_allclose(np.asarray(logp), batch.log_probs[:, k], rtol=0, atol=1e-6)
    without = {**{name: v[0] for name, v in per_step.items()}, **shared}
    del without["reference_latents"]
    with pytest.raises(ValueError, match="no reference_latents"):
        EDIT_WINDOW.log_prob(model, without, config)


@pytest.mark.slow  # two jitted gradient passes of the edit model, ~10 s each
@pytest.mark.parametrize("algorithm", ["nft", "awm"])
def test_the_forward_process_algorithms_train_on_the_edit_models_references(batch, algorithm):
    """DiffusionNFT and AWM call the model on the noised final latents through the family's objective
    (`Objective.velocity`): the edit model gets each row's reference latents, so the loss depends on them; without
    the family's conditioning (the text-to-image objective) the edit model refuses to run."""
    import jax
    from flax import nnx

    from jaxflow.algorithms import awm, nft
    from jaxflow.algorithms.objective import WINDOW
    from jaxflow.families.qwen_image.lora import QwenImageLoRASpec
    from jaxflow.nn.lora import LoRAParam

    model = load_transformer(tiny_folder() / "transformer", lora=QwenImageLoRASpec(rank=4, alpha=8.0),
                             model_type=QwenImageEditTransformer)
    graphdef, lora, frozen = nnx.split(model, LoRAParam, ...)
    lora = jax.tree.map(lambda x: x + 0.01, lora)  # B != 0: the LoRA's gradient flows through the model
    b = len(batch)
    mb = {"final_latents": jnp.asarray(batch.latents[:, -1]), "advantages": jnp.linspace(-1.0, 1.0, b),
          "sigmas": jnp.broadcast_to(jnp.asarray(batch.sigmas), (b, len(batch.sigmas))),
          "prompt_embeds": jnp.asarray(batch.prompt_embeds), "prompt_mask": jnp.asarray(batch.prompt_mask),
          "negative_prompt_embeds": jnp.asarray(batch.negative_prompt_embeds),
          "negative_prompt_mask": jnp.asarray(batch.negative_prompt_mask),
          "reference_latents": jnp.asarray(batch.reference_latents)}
    config = types.SimpleNamespace(grid_hw=(SIZE // 8, SIZE // 8), num_micro_batches=1, beta=0.0, adv_clip=5.0,
                                   guidance=1.0, nft_timesteps=2, nft_beta=1.0, awm_timesteps=2, awm_fraction=1.0,
                                   awm_power=1.0, awm_adv_max=1.0, awm_clip_range=0.2)

    def grads(step, objective):
        key = jax.random.PRNGKey(0)
        if algorithm == "nft":
            g, _ = nft.gradients(graphdef, lora, lora, frozen, step, key, config, objective=objective)
        else:
            g, _ = awm.gradients(graphdef, lora, frozen, step, key, config, objective=objective)
        return np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])

    with_refs = grads(mb, EDIT_WINDOW)
    assert np.all(np.isfinite(with_refs)) and np.any(with_refs != 0)
    swapped = grads({**mb, "reference_latents": mb["reference_latents"][::-1]}, EDIT_WINDOW)
    assert not np.allclose(swapped, with_refs, rtol=1e-3, atol=0)
    with pytest.raises(ValueError, match="needs the reference images' latents"):
        grads(mb, WINDOW)
