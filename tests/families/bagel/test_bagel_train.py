"""The training program on the tiny random BAGEL (configs/tiny_bagel_ocr.py, docs/bagel.md §7 (e)): two steps end to
end with the `bagel_torch` engine in a Ray actor (the brightness reward: OCR scores the random model 0, which would
leave every advantage 0), the LoRA synced every step, the exported adapter in BAGEL's names; the family's geometry
and its refusals."""
import jax
import numpy as np
import pytest

from jaxflow import families
from jaxflow.config.validation import config_module
from jaxflow.families.bagel.lora import peft_state_dict, read_peft
from tests.helpers import ROOT, run

LAYERS, TARGETS = 2, 7  # the tiny BAGEL's layers; the generation expert's seven adapted projections
pytestmark = pytest.mark.slow  # one trained pipeline (the module's fixture) serves every test


def bagel_config(run_dir):
    cfg = config_module(ROOT / "configs" / "tiny_bagel_ocr.py").get_config()
    cfg.run_dir = str(run_dir)
    cfg.log.progress = cfg.log.tensorboard = False
    cfg.rollout.num_cpus = 0.0  # never wait on the shared test Ray instance's CPUs
    cfg.reward.fns = {"brightness": 1.0}
    cfg.train.update(num_steps=2, learning_rate=1e-2)
    cfg.eval.every = 2
    return cfg


@pytest.fixture(scope="module")
def trained(ray_session, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("bagel_run")
    cfg = bagel_config(run_dir)
    return cfg, run_dir, run(cfg)


def test_two_steps_train_the_generation_expert_and_sync_every_step(trained):
    """The rollout started (its base weights' fingerprint equal to the trainer's: a mismatch stops the start), every
    step bound every adapted module on the engine, the gradient is nonzero (the reward spreads within groups) and
    the first, on-policy step's ratio is 1 within the recipe's clip range (the trainer's recompute of the rollout's
    log-probs: a misaligned context or latent would move it far beyond)."""
    cfg, _, out = trained
    history = out["history"]
    assert [h["step"] for h in history] == [1, 2]
    assert all(h["bound_modules"] == LAYERS * TARGETS for h in history)
    assert all(h["zero_std_ratio"] < 1 and h["grad_norm"] > 0 and np.isfinite(h["loss"]) for h in history)
    first = history[0]
    clip = cfg.train.clip_range
    assert 1 - clip < first["ratio_min"] <= first["ratio_max"] < 1 + clip, (first["ratio_min"], first["ratio_max"])
    assert "eval_reward_mean" in history[-1]


def test_the_export_is_the_final_lora_in_bagel_names_and_the_engine_takes_it(trained):
    from jaxflow_bridge.families.bagel.engine import BagelTorchEngine

    cfg, run_dir, out = trained
    spec, tensors = read_peft(run_dir / "lora_final")
    assert spec == families.of(cfg).lora_spec(cfg)
    want = peft_state_dict(jax.tree.map(np.asarray, out["state"].lora), spec)
    assert sorted(tensors) == sorted(want) and len(want) == 2 * LAYERS * TARGETS
    for key, value in want.items():
        np.testing.assert_array_equal(tensors[key], value, err_msg=key)
    assert any(np.any(v != 0) for k, v in tensors.items() if "lora_B" in k)  # trained: B moved from its zero init
    engine = BagelTorchEngine({"engine": "bagel_torch", "model": "tiny_bagel", "decode": "preview"})
    assert engine.update_lora(run_dir / "lora_final", 3)["bound_modules"] == LAYERS * TARGETS


def test_the_latent_grid_is_the_folder_geometry_and_bounded_by_its_position_table(tmp_path):
    cfg = bagel_config(tmp_path)
    family = families.of(cfg)
    folder = family.folder(cfg)
    assert family.grid_hw(folder, cfg) == (4, 6)  # 64 x 96 pixels, 16 a token
    cfg.sample.height = 16 * 33  # the tiny table holds 32 tokens a side
    with pytest.raises(ValueError, match=r"at most 32 a side \(512 pixels\)"):
        family.grid_hw(folder, cfg)


def test_the_trainer_fingerprint_is_the_engines_and_sees_a_changed_weight():
    """families.Bagel.fingerprint (first elements of each weight, torch layout, read from the Flax model) equals the
    bagel_torch engine's weights_fingerprint (its whole state dict) on the tiny folder; one changed element of one
    transposed kernel changes it."""
    from jaxflow.families.bagel.config import TINY
    from jaxflow.families.bagel.loading import arrays, build, load_bagel
    from jaxflow_bridge.families.bagel import keymap as bagel_keymap
    from jaxflow_bridge.families.bagel.engine import BagelTorchEngine
    from jaxflow_bridge.families.bagel.tiny import tiny_bagel_path

    model = load_bagel(tiny_bagel_path())
    family = families.Bagel()
    engine = BagelTorchEngine({"engine": "bagel_torch", "model": "tiny_bagel", "decode": "preview"})
    assert family.fingerprint(model) == engine.info()["fingerprint"]
    path = next(e.flax_path for e in bagel_keymap.key_map() if e.transpose and e.stacked)
    changed = dict(arrays(model))
    changed[path] = changed[path].copy()
    changed[path][1, 0, 0] += 1.0  # layer 1, the first element of its torch (out, in) weight
    assert family.fingerprint(build(TINY, changed)) != engine.info()["fingerprint"]


def test_more_than_one_trainer_device_is_refused_in_one_line(tmp_path):
    from jaxflow.config.errors import UserError
    from jaxflow.config.validation import check_layout
    cfg = bagel_config(tmp_path)
    check_layout(cfg, "cpu", 1)
    with pytest.raises(UserError, match=r"config\.model\.family: 'bagel' trains on one device .* JAX sees 2: set "
                                        r"CUDA_VISIBLE_DEVICES to one GPU"):
        check_layout(cfg, "gpu", 2)


def test_bagel_on_vllm_omni_is_a_valid_config_served_through_lora_layers(tmp_path):
    """BAGEL on the vllm_omni engine (bfloat16 on cuda) passes validation, and rollout.lora_apply='auto' serves its
    adapter through vLLM-Omni's LoRA layers (its pipeline has no merged path), where Qwen-Image's merges."""
    from jaxflow.config.plan import merged_lora
    from jaxflow.config.validation import validate
    from jaxflow.config.recipes import base
    cfg = bagel_config(tmp_path)
    cfg.rollout.update(engine="vllm_omni", dtype="bfloat16", device="cuda")
    validate(cfg)
    assert cfg.rollout.lora_apply == "auto" and not merged_lora(cfg)
    qwen = base()
    assert qwen.rollout.engine == "vllm_omni" and qwen.rollout.lora_apply == "auto" and merged_lora(qwen)


def test_bagel_lora_mode_is_the_one_its_engine_runs(tmp_path):
    """BAGEL's rollout.lora_apply='auto' is 'folder' on vllm_omni (vLLM-Omni's own apply, the engines' word for what
    was its "stock") and 'layers' on bagel_torch; 'layers' on vllm_omni (the fused apply, Qwen-Image's) is refused in
    one line naming 'folder', and the bagel_torch engine refuses a lora_apply that is not one of its sinks'."""
    from jaxflow.config.errors import UserError
    from jaxflow.config.plan import lora_apply
    from jaxflow.config.validation import validate
    from jaxflow_bridge.families.bagel.engine import BagelTorchEngine
    cfg = bagel_config(tmp_path)
    assert cfg.rollout.engine == "bagel_torch" and lora_apply(cfg) == "layers"
    cfg.rollout.update(engine="vllm_omni", dtype="bfloat16", device="cuda")
    assert lora_apply(cfg) == "folder"
    cfg.rollout.lora_apply = "layers"
    with pytest.raises(UserError, match=r"config\.rollout\.lora_apply: 'layers': BAGEL runs with 'auto' or 'folder' "
                                        r"on the vllm_omni engine"):
        validate(cfg)
    with pytest.raises(ValueError, match=r"bagel_torch engine: lora_apply 'fused'; choose one of \['folder', 'layers', "
                                         r"'merged'\]"):
        BagelTorchEngine({"engine": "bagel_torch", "model": "tiny_bagel", "lora_apply": "fused"})


def test_random_init_draws_the_engines_weights_by_checkpoint_name():
    """model.init=random: the trainer's BAGEL (drawn on the device into Flax layout) holds exactly the shared spec's
    tensors by checkpoint name, and its fingerprint is the bagel_torch engine's with the same random_seed (not with
    another seed)."""
    from jaxflow.families.bagel.config import TINY
    from jaxflow.families.bagel.loading import arrays, random_bagel
    from jaxflow_bridge.families.bagel import keymap as bagel_keymap
    from jaxflow_bridge.contract.random_weights import numpy_weight
    from jaxflow_bridge.families.bagel.engine import BagelTorchEngine

    model = random_bagel(TINY, seed=7)
    for name, value in bagel_keymap.to_checkpoint(arrays(model), TINY.num_hidden_layers).items():
        np.testing.assert_array_equal(value, numpy_weight(7, name, value.shape), err_msg=name)
    config = {"engine": "bagel_torch", "model": "tiny_bagel", "decode": "preview"}
    fingerprint = families.Bagel().fingerprint(model)
    assert fingerprint == BagelTorchEngine({**config, "random_seed": 7}).info()["fingerprint"]
    assert fingerprint != BagelTorchEngine({**config, "random_seed": 8}).info()["fingerprint"]
