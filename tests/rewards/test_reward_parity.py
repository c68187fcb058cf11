"""Each reward model scores as its reference code does (tests/rewards/reference_rewards.py: flow_grpo's PickScore
scorer, torchmetrics' CLIPScore, LAION's aesthetic script, hpsv2's score, ImageReward's), on non-square images and
prompts that its text cleaning and truncation change, with a CLIP BPE vocabulary that merges (learned offline: the
real one does not ship here), in the released checkpoint layouts (tests/rewards/reward_checkpoints.py).

Tolerance: the reward and its reference run the same float32 model on pixels that agree to a few ulp, so scores
agree to a few hundred ulp of their magnitude (the sums of the towers differ in order): TOL * magnitude."""
import html

import numpy as np
import pytest
import torch

from jaxflow_bridge.rewards.models import preprocess
from jaxflow_bridge.rewards.multi import build_reward
from tests.rewards import reference_rewards as ref
from tests.rewards import reward_checkpoints as ckpt

TOL = 256 * np.finfo(np.float32).eps
SIZE = 32  # the tiny towers' image size: (48, 101) resizes to (32, 67), 67 - 32 = 3 (mod 4), where crops differ
PROMPTS = ["a red fox “sitting” in the snow", "Fish &amp; chips on a plate", "ﬂuﬀy cats on a ｂｌｕｅ sofa",
           "A SIGN THAT SAYS   \"HELLO\"", "two cats\nsleeping",
           "a castle " + "with towers and flags " * 30, "the word OCR &lt;3", "a corgi wearing sunglasses"]


def fix_text(text: str) -> str:
    """ftfy.fix_text where ftfy is installed; else this project's transcription of its fixers (checked against
    ftfy's documented examples below)."""
    try:
        import ftfy
    except ImportError:
        return preprocess.fix_text(text)
    return ftfy.fix_text(text)


@pytest.fixture(scope="module")
def merges():
    return ckpt.learn_merges(ckpt.CORPUS, 300)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory, merges):
    return ckpt.write_clip_model(tmp_path_factory.mktemp("clip"), merges, image_size=SIZE)


@pytest.fixture(scope="module")
def images():
    """Eight non-square images: four landscape, four portrait (a batch has one shape)."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (4, 48, 101, 3), dtype=np.uint8), rng.integers(0, 256, (4, 101, 48, 3), np.uint8)]


def _both(images):
    return [(batch, PROMPTS[4 * i:4 * i + 4]) for i, batch in enumerate(images)]


def test_pixels_are_the_reference_pipelines(images):
    """"floor" is transformers' CLIP image processor (its PIL backend), "round" OpenAI CLIP's torchvision transform,
    "letterbox" hpsv2's; floor and round differ by a pixel's shift here."""
    from transformers import CLIPImageProcessorPil

    hf = CLIPImageProcessorPil(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE})
    for batch in images:
        got = {c: preprocess.Pixels(SIZE, ref.OPENAI_MEAN, ref.OPENAI_STD, c)(batch) for c in preprocess.CROPS}
        want = {"floor": hf(images=list(batch), return_tensors="pt")["pixel_values"],
                "round": torch.stack([ref.openai_clip_transform(im, SIZE) for im in batch]),
                "letterbox": torch.stack([ref.hpsv2_transform(im, SIZE) for im in batch])}
        for crop in preprocess.CROPS:  # values up to ~2.2: a few float32 ulp
            torch.testing.assert_close(got[crop], want[crop], rtol=0, atol=16 * 2.2 * np.finfo(np.float32).eps)
        assert (got["floor"] - got["round"]).abs().max() > 0.5
        black = (-torch.tensor(ref.OPENAI_MEAN) / torch.tensor(ref.OPENAI_STD))[:, None, None]
        edge = got["letterbox"][..., :, :8] if batch.shape[1] > batch.shape[2] else got["letterbox"][..., :8, :]
        torch.testing.assert_close(edge, black.expand_as(edge))  # the padding of the short side


def test_prompt_cleaning_is_ftfy_s_and_open_clip_s():
    """ftfy.fix_text's documented examples (ftfy/__init__.py), then open_clip's basic_clean and whitespace_clean."""
    assert preprocess.fix_text("ＬＯＵＤ　ＮＯＩＳＥＳ") == "LOUD NOISES"
    assert preprocess.fix_text("Broken text it&#x2019;s ﬂubberiﬁc!") == "Broken text it's flubberific!"
    assert preprocess.fix_text("&lt;tag&gt; <b>") == "&lt;tag&gt; <b>"  # text with "<" keeps its entities in ftfy
    assert preprocess.clean_prompt("  a “red”\n\tfox &amp;amp; ﬁsh ") == 'a "red" fox & fish'
    assert preprocess.clean_prompt("&lt;tag&gt; <b>") == html.unescape("&lt;tag&gt; <b>")


def test_hps_tokens_are_open_clip_s(clip_dir, merges):
    """The HPS reward's ids (cleaned prompt, fast tokenizer, 77 tokens, end token kept) are open_clip's tokenize."""
    from jaxflow_bridge.rewards.models.hps import Hps

    arch = _hps_arch(clip_dir)
    path = clip_dir.parent / "hps_tokens.pt"
    torch.save({"state_dict": ckpt.open_clip_state(arch)}, path)
    reward = Hps(path=str(path), processor_path=str(clip_dir), arch=arch)
    got = reward.tokens([preprocess.clean_prompt(p) for p in PROMPTS])["input_ids"]
    want = ref.OpenClipTokenizer(merges, fix_text)(PROMPTS)
    assert got.shape[1] == 77 and torch.equal(got, want[:, :got.shape[1]])
    assert max(len(ckpt_ids) for ckpt_ids in reward.tokenizer(PROMPTS)["input_ids"]) > 77  # truncation is exercised


def _hps_arch(clip_dir):
    n = len(ckpt.json.loads((clip_dir / "vocab.json").read_text()))
    text = {**ckpt.HPS_ARCH["text"], "vocab_size": n, "bos_token_id": n - 2, "eos_token_id": n - 1}
    return {**ckpt.HPS_ARCH, "text": text}


def test_pickscore_is_flow_grpo_s_scorer(clip_dir, images):
    from transformers import CLIPModel

    reward = build_reward({"pickscore": 1.0}, pickscore={"path": str(clip_dir), "batch_size": 3})
    assert reward.rewards["pickscore"].tokenizer.is_fast  # PickScore's AutoProcessor loads the fast one
    model, processor = CLIPModel.from_pretrained(clip_dir).eval(), ref.clip_processor(clip_dir)
    scale = model.logit_scale.exp().item() / 26
    for batch, prompts in _both(images):
        np.testing.assert_allclose(reward(batch, prompts)["pickscore"], ref.pickscore(model, processor, batch, prompts),
                                   rtol=0, atol=TOL * scale)


def test_clip_score_is_torchmetrics_clip_score(clip_dir, images):
    """100 * max(cos, 0); the long prompt is cut to 77 tokens without its end token, as torchmetrics cuts it."""
    from transformers import CLIPModel

    reward = build_reward({"clip_score": 1.0}, clip_score={"path": str(clip_dir)})
    model, processor = CLIPModel.from_pretrained(clip_dir).eval(), ref.clip_processor(clip_dir)
    for batch, prompts in _both(images):
        got = reward(batch, prompts)["clip_score"]
        np.testing.assert_allclose(got, ref.torchmetrics_clip_score(model, processor, batch, prompts), rtol=0,
                                   atol=TOL * 100)
        assert (got >= 0).all() and got.max() > 1  # on the 0-100 scale


def test_aesthetic_is_laion_s_script(clip_dir, images):
    from transformers import CLIPModel

    from jaxflow_bridge.rewards.models.clip import AestheticMLP

    torch.manual_seed(1)
    mlp = AestheticMLP(16).eval()
    path = clip_dir.parent / "sac+logos+ava1-l14-linearMSE.pth"
    torch.save(mlp.state_dict(), path)
    reward = build_reward({"aesthetic": 1.0}, aesthetic={"path": str(clip_dir), "mlp_path": str(path)})
    model = CLIPModel.from_pretrained(clip_dir).eval()
    for batch, prompts in _both(images):
        want = ref.laion_aesthetic(model, mlp, batch, SIZE)
        np.testing.assert_allclose(reward(batch, prompts)["aesthetic"], want, rtol=0,
                                   atol=TOL * max(1.0, np.abs(want).max()))


def test_hps_is_hpsv2_s_score(clip_dir, merges, images, tmp_path):
    arch = _hps_arch(clip_dir)
    sd = ckpt.open_clip_state(arch)
    path = tmp_path / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": sd}, path)
    reward = build_reward({"hps": 1.0}, hps={"path": str(path), "processor_path": str(clip_dir), "arch": arch})
    tokenizer = ref.OpenClipTokenizer(merges, fix_text)
    for batch, prompts in _both(images):
        want = ref.hpsv2_score(lambda px, ids: ckpt.open_clip_features(sd, arch, px, ids), tokenizer, batch, prompts,
                               SIZE)
        np.testing.assert_allclose(reward(batch, prompts)["hps"], want, rtol=0, atol=TOL)


def test_image_reward_is_image_reward_s_score(images, tmp_path):
    from transformers import BertTokenizer

    sd = ckpt.image_reward_state(ckpt.IR_VISION, ckpt.IR_MED)
    path, med, tok = ckpt.write_image_reward(tmp_path, sd)
    reward = build_reward({"image_reward": 1.0}, image_reward={"path": str(path), "med_config": str(med),
                                                               "tokenizer_path": str(tok), "vision": ckpt.IR_VISION})
    bert = BertTokenizer(str(tok / "vocab.txt"))
    for batch, prompts in _both(images):
        text = bert(prompts, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
        pixels = torch.stack([ref.openai_clip_transform(im, ckpt.IR_VISION["image_size"]) for im in batch])
        with torch.no_grad():
            want = ckpt.image_reward_forward(sd, ckpt.IR_VISION, ckpt.IR_MED, pixels, text["input_ids"],
                                             text["attention_mask"]).numpy()
        np.testing.assert_allclose(reward(batch, prompts)["image_reward"], want, rtol=0,
                                   atol=TOL * max(1.0, np.abs(want).max()))
