"""The embedded BAGEL engine (jaxflow_bridge/families/bagel/engine.py) on the tiny BAGEL folder, CPU float32: the
contexts it builds, the trajectories it returns, LoRA on the generation expert (against the adapter merged into the
weights), the adapters it refuses, leaving the previous one serving, and its images (the folder's autoencoder; the
other tests use the latent preview, which needs no decoder)."""
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from jaxflow_bridge.families.bagel.keymap import LORA_TARGETS, PEFT_PREFIX
from jaxflow_bridge.contract.lora_payload import LoRAPayload
from jaxflow_bridge.contract.served import ServedProbe, differing
from jaxflow_bridge.contract.trajectory import TrajectoryBatch
from jaxflow_bridge.families.bagel import tiny as tiny_bagel
from jaxflow_bridge.families.bagel.sampling import BagelSamplingLoop
from jaxflow_bridge.families.bagel.model import BagelTorch
from jaxflow_bridge.families.bagel.vae import BagelDecoder
from jaxflow_bridge.families.bagel.engine import BagelTorchEngine, context_ids
from jaxflow_bridge.rollout.server import engine_class
from tests.bagel_helpers import SP, V_TOL
from tests.helpers import expected_served

PROMPTS = ["a sign", "OCR 42"]
SAMPLING = dict(height=SP.height, width=SP.width, num_inference_steps=SP.num_inference_steps,
                sde_window_range=SP.sde_window_range, cfg_interval=SP.cfg_interval, cfg_text_scale=SP.cfg_text_scale)
RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_bagel.build_tiny_bagel(tmp_path_factory.mktemp("bagel") / "seed0")


@pytest.fixture(scope="module")
def engine(folder):
    return engine_class({"engine": "bagel_torch"})({"engine": "bagel_torch", "model": str(folder), "decode": "preview"})


def test_generate_pads_the_context_ids_to_text_tokens_with_the_same_numbers(engine):
    """The engine's trajectory arrives with its context ids padded to `text_tokens` (the train step's one text
    shape; the empty unconditional context to L' all-masked tokens), the samples as without."""
    plain = TrajectoryBatch.from_dict(engine.generate(PROMPTS, 2, SAMPLING, seeds=[1, 2, 3, 4]))
    length = plain.prompt_ids.shape[1]
    out = TrajectoryBatch.from_dict(engine.generate(PROMPTS, 2, {**SAMPLING, "text_tokens": (length + 5, 7)},
                                                    seeds=[1, 2, 3, 4]))
    assert out.prompt_ids.shape == out.prompt_mask.shape == (4, length + 5)
    assert out.negative_prompt_ids.shape == out.negative_prompt_mask.shape == (4, 7)
    np.testing.assert_array_equal(out.prompt_ids[:, :length], plain.prompt_ids)
    np.testing.assert_array_equal(out.prompt_mask[:, :length], plain.prompt_mask)
    assert not out.prompt_mask[:, length:].any() and not out.negative_prompt_mask.any()
    for field in ("images", "latents", "log_probs"):
        np.testing.assert_array_equal(getattr(out, field), getattr(plain, field))


def adapter(model: torch.nn.Module, seed: int = 1) -> dict[str, np.ndarray]:
    """A nonzero PEFT adapter (BAGEL's names, PEFT's prefix) on every generation-expert target of `model`."""
    rng, out = np.random.default_rng(seed), {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.endswith(tuple(f".{t}" for t in LORA_TARGETS)):
            out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = rng.normal(0, m.in_features ** -0.5, (RANK, m.in_features))
            out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = rng.normal(0, 0.3, (m.out_features, RANK))
    return {k: v.astype(np.float32) for k, v in out.items()}


def test_generate_returns_trajectories_of_the_prompts_contexts(engine, folder):
    out = TrajectoryBatch.from_dict(engine.generate(PROMPTS, 2, SAMPLING, seeds=[1, 2, 3, 4]))
    assert out.images.shape == (4, SP.height, SP.width, 3) and list(out.prompts) == [p for p in PROMPTS for _ in "ab"]
    ids = [context_ids(engine.tokenizer, p) for p in PROMPTS]
    start, end = engine.tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert all(i[0] == start and i[-1] == end and len(i) > 2 for i in ids)
    for row, mask, group in zip(out.prompt_ids, out.prompt_mask, out.group_ids):
        assert list(row[mask]) == ids[group] and not mask[len(ids[group]):].any()
    assert out.negative_prompt_ids.shape == (4, 0)  # CFG on: BAGEL's empty unconditional context
    # the engine adds nothing to the loop: the same contexts and seeds through the loop alone give the same bytes
    model = BagelTorch(**tiny_bagel.bagel_torch_fields(folder))
    model.load_checkpoint(load_file(folder / "ema.safetensors"))
    alone = BagelSamplingLoop(model).generate(ids, 2, SP, seeds=[1, 2, 3, 4])
    np.testing.assert_array_equal(out.latents, alone.latents)
    np.testing.assert_array_equal(out.log_probs, alone.log_probs)
    assert engine.info()["size_multiple"] == 16 and engine.info()["lora_modules"] == 0


def test_lora_adapts_the_generation_expert_as_merged_weights_do(folder):
    engine = BagelTorchEngine({"engine": "bagel_torch", "model": str(folder), "decode": "preview"})
    peft = adapter(engine.model)
    ids = torch.tensor([context_ids(engine.tokenizer, PROMPTS[0])])
    mask = torch.ones_like(ids, dtype=torch.bool)
    g = torch.Generator().manual_seed(0)
    x, sigma, grid = torch.randn(1, 24, engine.model.latent_dim, generator=g), torch.tensor([0.7]), (4, 6)
    with torch.no_grad():
        base = engine.model.velocity(x, sigma, engine.model.prefill(ids, mask), grid)
        info = engine.update_lora(peft, 3, {"r": RANK, "lora_alpha": ALPHA})
        adapted = engine.model.velocity(x, sigma, engine.model.prefill(ids, mask), grid)
    assert (info["version"], info["bound_modules"]) == (3, len(peft) // 2)
    assert engine.info()["lora_modules"] == len(peft) // 2
    sd = {k: v.clone() for k, v in load_file(folder / "ema.safetensors").items()}
    for key, a in peft.items():
        if ".lora_A." in key:
            module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
            b = peft[key.replace(".lora_A.", ".lora_B.")]
            sd[f"{module}.weight"] += torch.from_numpy((ALPHA / RANK * (b.astype(np.float64) @ a)).astype(np.float32))
    merged = BagelTorch(**tiny_bagel.bagel_torch_fields(folder))
    merged.load_checkpoint(sd)
    with torch.no_grad():
        want = merged.velocity(x, sigma, merged.prefill(ids, mask), grid)
    scale = float(want.abs().max())
    assert float((adapted - want).abs().max()) <= V_TOL * scale  # the velocities' own float32 parity bound
    assert float((adapted - base).abs().max()) > 1000 * V_TOL * scale  # the adapter moves it far beyond that
    out = TrajectoryBatch.from_dict(engine.generate(PROMPTS[:1], 2, SAMPLING, seeds=[1, 2]))
    assert list(out.policy_versions) == [3, 3]


@pytest.mark.parametrize("mode", ["layers", "merged", "folder"])
def test_every_sink_reports_what_it_serves_under_the_payloads_names(folder, mode):
    """Each apply mode's reply carries the served probe under the trainer's PEFT names (BAGEL's prefix kept), within
    tolerance of what the payload asks; a sink still holding version 1 when asked for version 2 is caught."""
    engine = BagelTorchEngine({"engine": "bagel_torch", "model": str(folder), "decode": "preview", "lora_apply": mode})
    config = {"r": RANK, "lora_alpha": ALPHA}
    v1, v2 = (LoRAPayload(v, config, adapter(engine.model, seed=v)) for v in (1, 2))
    probe = ServedProbe.from_dict(engine.update_lora(v1.tensors, 1, config)["served"])
    assert probe.bound_modules == len(v1.tensors) // 2 and all(m.startswith(PEFT_PREFIX) for m in probe.deltas)
    assert differing(expected_served(v1), probe) == []
    assert differing(expected_served(v2), engine.lora.served(v2)) == sorted(expected_served(v2))
    assert engine.info()["lora_apply"] == mode


@pytest.mark.parametrize("mutate, needle", [
    (lambda p: {k.replace("q_proj_moe_gen", "q_proj"): v for k, v in p.items()}, "off the generation expert"),
    (lambda p: {k: (v[:, :-1] if ".lora_A." in k else v) for k, v in p.items()}, "expected shape"),
    (lambda p: {k: v * np.float32("nan") for k, v in p.items()}, "finite"),
])
def test_a_refused_adapter_leaves_the_previous_one_serving(folder, mutate, needle):
    engine = BagelTorchEngine({"engine": "bagel_torch", "model": str(folder), "decode": "preview"})
    peft, second = adapter(engine.model), adapter(engine.model, seed=2)  # names read before LoRA wraps them
    engine.update_lora(peft, 1, {"r": RANK, "lora_alpha": ALPHA})
    before = engine.generate(PROMPTS[:1], 2, SAMPLING, seeds=[5, 6])
    with pytest.raises(ValueError, match=needle) as err:
        engine.update_lora(mutate(second), 2)
    assert "the previous adapter keeps serving" in str(err.value) and "\n" not in str(err.value)
    after = engine.generate(PROMPTS[:1], 2, SAMPLING, seeds=[5, 6])
    np.testing.assert_array_equal(after["latents"], before["latents"])
    assert engine.info()["policy_version"] == 1


@pytest.mark.slow
def test_images_are_the_folders_autoencoder_decoding_the_final_latents(folder):
    engine = BagelTorchEngine({"engine": "bagel_torch", "model": str(folder)})  # decode="vae", the default
    small = dict(SAMPLING, height=32, width=48, keep_final=True)
    out = TrajectoryBatch.from_dict(engine.generate(PROMPTS[:1], 2, small, seeds=[7, 8]))
    want = BagelDecoder(load_file(folder / "ae.safetensors"))(torch.from_numpy(out.final_latents), (2, 3))
    assert out.images.shape == (2, 32, 48, 3) and out.images.std() > 0
    np.testing.assert_array_equal(out.images, want)


def test_bad_engine_configs_are_refused_in_one_line(folder, tmp_path):
    (tmp_path / "ema.safetensors").write_bytes((folder / "ema.safetensors").read_bytes())
    for config, needle in ((dict(model=str(tmp_path / "none")), "no ema.safetensors"),
                           (dict(model=str(tmp_path)), "no ae.safetensors"),
                           (dict(model=str(folder), decode="jpeg"), "choose 'vae' or 'preview'"),
                           (dict(model=str(folder), dtype="bf16"), "dtype 'bf16' is not supported yet"),
                           (dict(model=str(folder), device="cuda"), "pass 'cpu'")):
        with pytest.raises(ValueError, match=needle):
            BagelTorchEngine({"engine": "bagel_torch", **config})
