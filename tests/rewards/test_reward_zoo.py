"""Reward models (jaxflow_bridge/rewards/) on tiny random models saved in the layout of the real checkpoints (CLIPModel
folders with the processor's files, the aesthetic predictor's state dict, HPS v2.1's open_clip checkpoint,
ImageReward.pt with its med_config.json and BERT vocabulary), loaded through the registry as a run builds them."""
import importlib.util
import subprocess
import sys

import numpy as np
import pytest
import torch

from jaxflow_bridge.rewards.multi import build_reward
from tests.helpers import ROOT, tiny_config
from tests.rewards import reward_checkpoints as ckpt
from tests import HANG_S

PROMPTS = ["a red fox", "a sign that says hello", "two cats", "a blue car", "the word OCR"]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    """A tiny random CLIPModel with its processor's files, as scripts/make_random_pickscore.py --tiny writes it (the
    PickScore_v1 layout; a byte-level tokenizer, bos 512 and eos 513)."""
    spec = importlib.util.spec_from_file_location("script", ROOT / "scripts" / "make_random_pickscore.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.write(tmp_path_factory.mktemp("clip"), tiny=True)


@pytest.fixture(scope="module")
def mlp_path(clip_dir):
    from jaxflow_bridge.rewards.models.clip import AestheticMLP

    torch.manual_seed(1)
    path = clip_dir.parent / "sac+logos+ava1-l14-linearMSE.pth"
    torch.save(AestheticMLP(16).state_dict(), path)
    return path


@pytest.fixture(scope="module")
def images():
    return np.random.default_rng(0).integers(0, 256, (5, 40, 56, 3), dtype=np.uint8)


def _reference(clip_dir, images, prompts):
    """CLIPModel's own forward: logits_per_image = exp(logit_scale) * normalised image @ normalised text."""
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(clip_dir).eval()
    inputs = CLIPProcessor.from_pretrained(clip_dir)(text=prompts, images=list(images), return_tensors="pt",
                                                     padding=True)
    with torch.no_grad():
        out = model(**inputs)
    return model, out


@pytest.mark.parametrize("name", ["pickscore", "clip_score"])
def test_text_image_rewards_match_clip_s_own_logits_and_do_not_depend_on_the_batch(name, clip_dir, images):
    whole = build_reward({name: 1.0}, **{name: {"path": str(clip_dir), "batch_size": 5}})
    pieces = build_reward({name: 1.0}, **{name: {"path": str(clip_dir), "batch_size": 2}})
    got = whole(images, PROMPTS)[name]
    model, out = _reference(clip_dir, images, PROMPTS)
    logits = out.logits_per_image.diag().numpy()
    want = logits / 26.0 if name == "pickscore" else 100 * np.maximum(logits / model.logit_scale.exp().item(), 0)
    assert got.dtype == np.float32 and got.shape == (5,)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(pieces(images, PROMPTS)[name], got, rtol=1e-5, atol=1e-4)
    assert np.ptp(got) > 0  # the images and prompts differ, so must the scores


def test_aesthetic_is_the_predictor_on_the_normalised_image_embedding(clip_dir, mlp_path, images):
    from jaxflow_bridge.rewards.models.clip import AestheticMLP

    reward = build_reward({"aesthetic": 1.0}, aesthetic={"path": str(clip_dir), "mlp_path": str(mlp_path),
                                                         "batch_size": 3})
    got = reward(images, PROMPTS)["aesthetic"]
    _, out = _reference(clip_dir, images, PROMPTS)
    mlp = AestheticMLP(16)
    mlp.load_state_dict(torch.load(mlp_path))
    mlp.eval()
    with torch.no_grad():
        want = mlp(out.image_embeds).squeeze(-1).numpy()  # image_embeds: projected and L2-normalised
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_missing_file_is_named_in_one_line(clip_dir, tmp_path):
    partial = tmp_path / "PickScore_v1"
    partial.mkdir()
    (partial / "config.json").write_text((clip_dir / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match=r"reward 'pickscore': reward\.options\.pickscore\.path=.*PickScore_v1 "
                                                r"lacks model\.safetensors or pytorch_model\.bin$"):
        build_reward({"pickscore": 1.0}, pickscore={"path": str(partial)})
    with pytest.raises(FileNotFoundError, match=r"processor_path=.*lacks preprocessor_config\.json, "
                                                r"tokenizer_config\.json, vocab\.json or tokenizer\.json$"):
        build_reward({"pickscore": 1.0}, pickscore={"path": str(clip_dir), "processor_path": str(partial)})
    with pytest.raises(FileNotFoundError, match="needs reward.options.aesthetic.mlp_path"):
        build_reward({"aesthetic": 1.0}, aesthetic={"path": str(clip_dir)})
    with pytest.raises(FileNotFoundError, match="needs reward.options.clip_score.path"):
        build_reward({"clip_score": 1.0})


def test_reward_models_are_imported_only_when_used():
    code = ("import sys; from jaxflow_bridge.rewards.multi import build_reward; build_reward({'brightness': 1.0}); "
            "print('jaxflow_bridge.rewards.models.clip' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert out.stdout.split() == ["False", "False"], out.stderr[-2000:]


@pytest.mark.slow
def test_the_trainer_stops_with_one_line_when_a_reward_checkpoint_is_incomplete(tmp_path):
    args = [sys.executable, "-m", "jaxflow.train", "--config", str(ROOT / "configs" / "tiny_ocr.py"),
            f"--config.run_dir={tmp_path / 'run'}", "--config.rollout.layout=in_process",
            "--config.reward.fns={'pickscore': 1.0}", f"--config.reward.options={{'pickscore': {{'path': '{tmp_path}'}}}}"]
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: reward 'pickscore': reward.options.pickscore.path={tmp_path} lacks config.json, "
                      f"model.safetensors or pytorch_model.bin"], out.stderr[-3000:]
    assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()


def test_the_pickscore_recipe_is_the_ocr_recipe_with_its_reward_and_prompts(tiny_path):
    """configs/qwen_pickscore.py: flow_grpo's pickscore_qwenimage differs from the OCR recipe in reward and prompts
    only; its prompt files (no quoted targets) are asked for at start."""
    from jaxflow.config import validation as config_lib
    from jaxflow.run.run_dir import flatten

    def load(name):
        return config_lib.config_module(ROOT / "configs" / f"{name}.py").get_config()

    pick, ocr = load("qwen_pickscore"), load("qwen_ocr")
    a, b = flatten(pick.to_dict()), flatten(ocr.to_dict())
    assert sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k)) == [
        "data.test", "data.train", "reward.fns.ocr", "reward.fns.pickscore", "reward.options.ocr.num_threads",
        "reward.options.pickscore.batch_size", "reward.options.pickscore.device", "reward.options.pickscore.dtype",
        "reward.options.pickscore.path", "reward.options.pickscore.processor_path", "reward.workers", "run_dir"]
    assert not config_lib.needs_target(pick) and config_lib.needs_target(ocr)
    assert pick.reward.options.pickscore.dtype == "float32"  # flow_grpo's PickScoreScorer scores in float32
    pick.model.path = str(tiny_path)
    with pytest.raises(ValueError, match="config.data.train: '' is not a file"):
        config_lib.validate(pick)


@pytest.mark.slow
def test_a_reward_model_in_its_own_ray_actor_scores_as_in_process(ray_session, clip_dir, images, tmp_path):
    """reward.options.<name>.actor: the model loads and scores in a Ray actor (its own process); the same scores as
    in the trainer's process, and a load error comes back as the same one-line exception."""
    local = build_reward({"pickscore": 1.0}, pickscore={"path": str(clip_dir)})(images, PROMPTS)["pickscore"]
    remote = build_reward({"pickscore": 1.0}, pickscore={"path": str(clip_dir), "actor": {"num_cpus": 0}})
    assert type(remote.rewards["pickscore"]).__name__ == "RemoteReward"
    np.testing.assert_allclose(remote(images, PROMPTS)["pickscore"], local, rtol=1e-6, atol=1e-7)
    with pytest.raises(FileNotFoundError, match=r"reward\.options\.pickscore\.path=.* lacks config\.json"):
        build_reward({"pickscore": 1.0}, pickscore={"path": str(tmp_path), "actor": {"num_cpus": 0}})


def test_a_reward_actor_needs_ray_so_not_the_in_process_layout(tmp_path):
    from jaxflow.config import validation as config_lib

    cfg = tiny_config(tmp_path)
    cfg.reward.fns = {"pickscore": 1.0}
    cfg.reward.options = {"pickscore": {"path": "/models/PickScore_v1", "actor": {"num_gpus": 1}}}
    cfg.rollout.layout = "in_process"
    with pytest.raises(config_lib.UserError, match="reward.options.pickscore.actor: puts the reward model in a Ray "
                                                   "actor; the in_process layout runs without Ray"):
        config_lib.validate(cfg)


def test_hps_loads_the_open_clip_checkpoint_and_names_what_does_not_fit(clip_dir, images, tmp_path):
    """HPS v2.1: the open_clip checkpoint ({"state_dict": ...}) loads into transformers' CLIP by the key map (its
    scores against hpsv2's: test_reward_parity.py); any batch split; missing files and foreign keys named in one
    line."""
    sd = ckpt.open_clip_state(ckpt.HPS_ARCH)
    path = tmp_path / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": sd}, path)
    options = {"path": str(path), "processor_path": str(clip_dir), "arch": ckpt.HPS_ARCH}
    got = build_reward({"hps": 1.0}, hps={**options, "batch_size": 5})(images, PROMPTS)["hps"]
    pieces = build_reward({"hps": 1.0}, hps={**options, "batch_size": 2})(images, PROMPTS)["hps"]
    np.testing.assert_allclose(pieces, got, rtol=1e-5, atol=1e-6)
    assert got.dtype == np.float32 and np.ptp(got) > 0
    with pytest.raises(FileNotFoundError, match=r"needs reward\.options\.hps\.path: the HPS v2\.1 checkpoint"):
        build_reward({"hps": 1.0}, hps={"processor_path": str(clip_dir)})
    with pytest.raises(FileNotFoundError, match=r"needs reward\.options\.hps\.processor_path"):
        build_reward({"hps": 1.0}, hps={"path": str(path)})
    torch.save({"state_dict": {**sd, "visual.head.weight": torch.zeros(2)}}, path)
    with pytest.raises(ValueError, match=r"not open_clip CLIP keys, e\.g\. \['visual\.head\.weight'\]"):
        build_reward({"hps": 1.0}, hps=options)


def test_image_reward_loads_its_released_state_dict_and_names_what_does_not_fit(images, tmp_path):
    """ImageReward: ImageReward.pt as released (BERT's position_ids buffer included) loads into transformers' BLIP
    classes by the key map (its scores against ImageReward's: test_reward_parity.py); any batch split; missing files
    and foreign keys named in one line."""
    sd = ckpt.image_reward_state(ckpt.IR_VISION, ckpt.IR_MED)
    assert "blip.text_encoder.embeddings.position_ids" in sd
    path, med, tok = ckpt.write_image_reward(tmp_path, sd)
    options = {"path": str(path), "med_config": str(med), "tokenizer_path": str(tok), "vision": ckpt.IR_VISION}
    got = build_reward({"image_reward": 1.0}, image_reward={**options, "batch_size": 5})(images, PROMPTS)
    got = got["image_reward"]
    pieces = build_reward({"image_reward": 1.0}, image_reward={**options, "batch_size": 2})(images, PROMPTS)
    np.testing.assert_allclose(pieces["image_reward"], got, rtol=1e-5, atol=1e-6)
    assert got.dtype == np.float32 and np.ptp(got) > 0
    with pytest.raises(FileNotFoundError, match=r"needs reward\.options\.image_reward\.med_config"):
        build_reward({"image_reward": 1.0}, image_reward={**options, "med_config": None})
    with pytest.raises(FileNotFoundError, match=r"reward\.options\.image_reward\.tokenizer_path=.* lacks vocab\.txt"):
        build_reward({"image_reward": 1.0}, image_reward={**options, "tokenizer_path": str(tmp_path)})
    torch.save({**sd, "blip.itm_head.weight": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match=r"not ImageReward's, e\.g\. \['blip\.itm_head\.weight'\]"):
        build_reward({"image_reward": 1.0}, image_reward=options)
