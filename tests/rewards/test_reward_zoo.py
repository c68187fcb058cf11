"""Reward models (jaxflow_bridge/rewards/) on tiny random models saved in the layout of the real checkpoints (CLIPModel
folders with the processor's files, the aesthetic predictor's state dict, HPS v2.1's open_clip checkpoint,
ImageReward.pt with its med_config.json and BERT vocabulary), loaded through the registry as a run builds them."""
import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from jaxflow_bridge.rewards.multi import build_reward
from tests.helpers import ROOT, tiny_config
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
    from jaxflow_bridge.rewards.clip import AestheticMLP

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
    want = logits / 26.0 if name == "pickscore" else logits / model.logit_scale.exp().item()
    assert got.dtype == np.float32 and got.shape == (5,)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pieces(images, PROMPTS)[name], got, rtol=1e-5, atol=1e-6)
    assert np.ptp(got) > 0  # the images and prompts differ, so must the scores


def test_aesthetic_is_the_predictor_on_the_normalised_image_embedding(clip_dir, mlp_path, images):
    from jaxflow_bridge.rewards.clip import AestheticMLP

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
            "print('jaxflow_bridge.rewards.clip' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert out.stdout.split() == ["False", "False"], out.stderr[-2000:]


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


HPS_ARCH = dict(vision=dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=37),
                text=dict(vocab_size=520, max_position_embeddings=77, hidden_size=24, num_hidden_layers=2,
                          num_attention_heads=2, intermediate_size=29, bos_token_id=512, eos_token_id=513),
                projection_dim=16)


def _open_clip_state(arch: dict, seed: int = 3) -> dict:
    """A random state dict with open_clip CLIP's keys and shapes (what HPS_v2.1_compressed.pt holds, at `arch`)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, base=0.0):
        return base + 0.2 * torch.randn(*shape, generator=g)

    v, t = arch["vision"], arch["text"]
    d, w, e, p = v["hidden_size"], t["hidden_size"], arch["projection_dim"], v["patch_size"]
    sd = {"visual.conv1.weight": r(d, 3, p, p), "visual.class_embedding": r(d),
          "visual.positional_embedding": r((v["image_size"] // p) ** 2 + 1, d), "visual.proj": r(d, e),
          "token_embedding.weight": r(t["vocab_size"], w), "positional_embedding": r(t["max_position_embeddings"], w),
          "text_projection": r(w, e), "logit_scale": torch.tensor(4.6)}
    for name, width in (("visual.ln_pre", d), ("visual.ln_post", d), ("ln_final", w)):
        sd[f"{name}.weight"], sd[f"{name}.bias"] = r(width, base=1.0), r(width)
    for tower, width, c in (("visual.transformer", d, v), ("transformer", w, t)):
        mlp = c["intermediate_size"]
        for i in range(c["num_hidden_layers"]):
            b = f"{tower}.resblocks.{i}."
            for ln in ("ln_1", "ln_2"):
                sd[b + ln + ".weight"], sd[b + ln + ".bias"] = r(width, base=1.0), r(width)
            sd.update({b + "attn.in_proj_weight": r(3 * width, width), b + "attn.in_proj_bias": r(3 * width),
                       b + "attn.out_proj.weight": r(width, width), b + "attn.out_proj.bias": r(width),
                       b + "mlp.c_fc.weight": r(mlp, width), b + "mlp.c_fc.bias": r(mlp),
                       b + "mlp.c_proj.weight": r(width, mlp), b + "mlp.c_proj.bias": r(width)})
    return sd


def _open_clip_features(sd: dict, arch: dict, pixels: torch.Tensor, ids: torch.Tensor):
    """open_clip's CLIP forward written out from its state dict (VisionTransformer and the text tower: pre-LN
    residual blocks over nn.MultiheadAttention, GELU MLPs, the class token / the first end-of-text token (the largest
    id) projected as x @ proj), normalised features. open_clip itself is not installed here."""
    F = torch.nn.functional

    def ln(x, name):
        return F.layer_norm(x, x.shape[-1:], sd[name + ".weight"], sd[name + ".bias"], 1e-5)

    def tower(x, prefix, heads, layers, mask=None):
        for i in range(layers):
            b = f"{prefix}.resblocks.{i}."
            h = ln(x, b + "ln_1").transpose(0, 1)  # (L, B, D), nn.MultiheadAttention's layout
            a, _ = F.multi_head_attention_forward(
                h, h, h, x.shape[-1], heads, sd[b + "attn.in_proj_weight"], sd[b + "attn.in_proj_bias"], None, None,
                False, 0.0, sd[b + "attn.out_proj.weight"], sd[b + "attn.out_proj.bias"], training=False,
                need_weights=False, attn_mask=mask)
            x = x + a.transpose(0, 1)
            h = F.gelu(F.linear(ln(x, b + "ln_2"), sd[b + "mlp.c_fc.weight"], sd[b + "mlp.c_fc.bias"]))
            x = x + F.linear(h, sd[b + "mlp.c_proj.weight"], sd[b + "mlp.c_proj.bias"])
        return x

    v, t = arch["vision"], arch["text"]
    x = F.conv2d(pixels, sd["visual.conv1.weight"], stride=v["patch_size"]).flatten(2).transpose(1, 2)
    x = torch.cat([sd["visual.class_embedding"].expand(len(x), 1, -1), x], dim=1) + sd["visual.positional_embedding"]
    x = tower(ln(x, "visual.ln_pre"), "visual.transformer", v["num_attention_heads"], v["num_hidden_layers"])
    image = ln(x[:, 0], "visual.ln_post") @ sd["visual.proj"]
    n = ids.shape[1]
    causal = torch.full((n, n), float("-inf")).triu(1)
    x = sd["token_embedding.weight"][ids] + sd["positional_embedding"][:n]
    x = ln(tower(x, "transformer", t["num_attention_heads"], t["num_hidden_layers"], causal), "ln_final")
    text = x[torch.arange(len(ids)), ids.argmax(-1)] @ sd["text_projection"]
    return F.normalize(image, dim=-1), F.normalize(text, dim=-1)


def test_hps_runs_the_open_clip_checkpoint_as_open_clip_would(clip_dir, images, tmp_path):
    """HPS v2.1: the open_clip checkpoint ({"state_dict": ...}) loaded into transformers' CLIP by the key map scores
    cos(image, text) as open_clip's own forward does on the same pixels and tokens; any batch split; missing files
    and foreign keys named in one line."""
    from transformers import CLIPProcessor

    sd = _open_clip_state(HPS_ARCH)
    path = tmp_path / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": sd}, path)
    options = {"path": str(path), "processor_path": str(clip_dir), "arch": HPS_ARCH}
    got = build_reward({"hps": 1.0}, hps={**options, "batch_size": 5})(images, PROMPTS)["hps"]
    inputs = CLIPProcessor.from_pretrained(clip_dir)(text=PROMPTS, images=list(images), return_tensors="pt",
                                                     padding=True)
    with torch.no_grad():
        image, text = _open_clip_features(sd, HPS_ARCH, inputs["pixel_values"], inputs["input_ids"])
    np.testing.assert_allclose(got, (image * text).sum(-1).numpy(), rtol=1e-5, atol=1e-6)
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


IR_VISION = dict(image_size=32, patch_size=8, hidden_size=24, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=29)
IR_MED = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=27,
              max_position_embeddings=64, layer_norm_eps=1e-12, hidden_act="gelu", encoder_width=24,
              add_cross_attention=True, pad_token_id=0)
IR_WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "red", "fox", "sign", "that", "says", "hello", "two",
            "cats", "blue", "car", "the", "word", "ocr"]


def _image_reward_state(seed: int = 5) -> dict:
    """A random state dict with ImageReward.pt's keys (BLIP's timm-style ViT, its BERT with cross-attention and its
    position_ids buffer, the contrastive projections, the MLP) at the tiny sizes above."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, base=0.0):
        return base + 0.2 * torch.randn(*shape, generator=g)

    v, m = IR_VISION, IR_MED
    d, h, p = v["hidden_size"], m["hidden_size"], v["patch_size"]
    sd = {"blip.visual_encoder.cls_token": r(1, 1, d), "blip.visual_encoder.patch_embed.proj.weight": r(d, 3, p, p),
          "blip.visual_encoder.patch_embed.proj.bias": r(d),
          "blip.visual_encoder.pos_embed": r(1, (v["image_size"] // p) ** 2 + 1, d),
          "blip.visual_encoder.norm.weight": r(d, base=1.0), "blip.visual_encoder.norm.bias": r(d),
          "blip.vision_proj.weight": r(8, d), "blip.vision_proj.bias": r(8), "blip.text_proj.weight": r(8, h),
          "blip.text_proj.bias": r(8), "blip.text_encoder.embeddings.word_embeddings.weight": r(m["vocab_size"], h),
          "blip.text_encoder.embeddings.position_embeddings.weight": r(m["max_position_embeddings"], h),
          "blip.text_encoder.embeddings.LayerNorm.weight": r(h, base=1.0),
          "blip.text_encoder.embeddings.LayerNorm.bias": r(h),
          # a buffer of BLIP's BERT, saved in the released ImageReward.pt
          "blip.text_encoder.embeddings.position_ids": torch.arange(m["max_position_embeddings"]).expand(1, -1)}
    for i in range(v["num_hidden_layers"]):
        b = f"blip.visual_encoder.blocks.{i}."
        for name, shape in (("norm1", (d,)), ("norm2", (d,))):
            sd[b + name + ".weight"], sd[b + name + ".bias"] = r(*shape, base=1.0), r(*shape)
        for name, (o, n) in (("attn.qkv", (3 * d, d)), ("attn.proj", (d, d)), ("mlp.fc1", (v["intermediate_size"], d)),
                             ("mlp.fc2", (d, v["intermediate_size"]))):
            sd[b + name + ".weight"], sd[b + name + ".bias"] = r(o, n), r(o)
    for i in range(m["num_hidden_layers"]):
        b = f"blip.text_encoder.encoder.layer.{i}."
        for att, width in (("attention", h), ("crossattention", d)):
            for name, n in (("query", h), ("key", width), ("value", width)):
                sd[f"{b}{att}.self.{name}.weight"], sd[f"{b}{att}.self.{name}.bias"] = r(h, n), r(h)
            sd[f"{b}{att}.output.dense.weight"], sd[f"{b}{att}.output.dense.bias"] = r(h, h), r(h)
            sd[f"{b}{att}.output.LayerNorm.weight"], sd[f"{b}{att}.output.LayerNorm.bias"] = r(h, base=1.0), r(h)
        sd[b + "intermediate.dense.weight"], sd[b + "intermediate.dense.bias"] = r(m["intermediate_size"], h), r(
            m["intermediate_size"])
        sd[b + "output.dense.weight"], sd[b + "output.dense.bias"] = r(h, m["intermediate_size"]), r(h)
        sd[b + "output.LayerNorm.weight"], sd[b + "output.LayerNorm.bias"] = r(h, base=1.0), r(h)
    for i, (o, n) in zip((0, 2, 4, 6, 7), ((1024, h), (128, 1024), (64, 128), (16, 64), (1, 16))):
        sd[f"mlp.layers.{i}.weight"], sd[f"mlp.layers.{i}.bias"] = r(o, n) / n ** 0.5, r(o)
    return sd


def _image_reward_reference(sd: dict, pixels: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """ImageReward's score written out from its state dict: BLIP's ViT (timm blocks: pre-LN, fused qkv, LayerNorm eps
    1e-6, final norm over every token), its BERT (post-LN; self-attention over the unpadded tokens, cross-attention
    to every image token), [CLS] -> MLP -> (r - mean) / std."""
    F = torch.nn.functional

    def ln(x, name, eps):
        return F.layer_norm(x, x.shape[-1:], sd[name + ".weight"], sd[name + ".bias"], eps)

    def lin(x, name):
        return F.linear(x, sd[name + ".weight"], sd[name + ".bias"])

    def attend(q, k, v, heads, bias=None):
        b, n, w = q.shape
        split = [t.reshape(b, -1, heads, w // heads).transpose(1, 2) for t in (q, k, v)]
        scores = split[0] @ split[1].transpose(-1, -2) / (w // heads) ** 0.5
        if bias is not None:
            scores = scores + bias
        return (scores.softmax(-1) @ split[2]).transpose(1, 2).reshape(b, n, w)

    v, m, e = IR_VISION, IR_MED, "blip.visual_encoder."
    x = F.conv2d(pixels, sd[e + "patch_embed.proj.weight"], sd[e + "patch_embed.proj.bias"], stride=v["patch_size"])
    x = torch.cat([sd[e + "cls_token"].expand(len(x), -1, -1), x.flatten(2).transpose(1, 2)], 1) + sd[e + "pos_embed"]
    for i in range(v["num_hidden_layers"]):
        b = f"{e}blocks.{i}."
        q, k, val = lin(ln(x, b + "norm1", 1e-6), b + "attn.qkv").chunk(3, dim=-1)
        x = x + lin(attend(q, k, val, v["num_attention_heads"]), b + "attn.proj")
        x = x + lin(F.gelu(lin(ln(x, b + "norm2", 1e-6), b + "mlp.fc1")), b + "mlp.fc2")
    image = ln(x, e + "norm", 1e-6)
    t, eps = "blip.text_encoder.", m["layer_norm_eps"]
    h = sd[t + "embeddings.word_embeddings.weight"][ids] + sd[t + "embeddings.position_embeddings.weight"][
        :ids.shape[1]]
    h = ln(h, t + "embeddings.LayerNorm", eps)
    pad = (1.0 - mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
    for i in range(m["num_hidden_layers"]):
        b = f"{t}encoder.layer.{i}."
        for att, source, bias in (("attention", h, pad), ("crossattention", image, None)):
            s = f"{b}{att}.self."
            out = attend(lin(h, s + "query"), lin(source, s + "key"), lin(source, s + "value"),
                         m["num_attention_heads"], bias)
            h = ln(lin(out, f"{b}{att}.output.dense") + h, f"{b}{att}.output.LayerNorm", eps)
        h = ln(lin(F.gelu(lin(h, b + "intermediate.dense")), b + "output.dense") + h, b + "output.LayerNorm", eps)
    out = h[:, 0]
    for i in (0, 2, 4, 6, 7):
        out = lin(out, f"mlp.layers.{i}")
    return (out.squeeze(-1) - 0.16717362830052426) / 1.0333394966054072


def test_image_reward_runs_its_blip_checkpoint_as_blip_would(images, tmp_path):
    """ImageReward: the checkpoint's BLIP ViT and BERT loaded into transformers' BLIP classes by the key map score as
    BLIP's own forward written out (same pixels and 35-token prompts); any batch split; missing files and foreign
    keys named in one line."""
    from transformers import BertTokenizer, CLIPImageProcessor

    sd = _image_reward_state()
    path, med, tok = tmp_path / "ImageReward.pt", tmp_path / "med_config.json", tmp_path / "bert-base-uncased"
    torch.save(sd, path)
    med.write_text(json.dumps(IR_MED))
    tok.mkdir()
    (tok / "vocab.txt").write_text("\n".join(IR_WORDS) + "\n")
    options = {"path": str(path), "med_config": str(med), "tokenizer_path": str(tok), "vision": IR_VISION}
    got = build_reward({"image_reward": 1.0}, image_reward={**options, "batch_size": 5})(images, PROMPTS)
    got = got["image_reward"]
    text = BertTokenizer(str(tok / "vocab.txt"))(PROMPTS, padding="max_length", max_length=35, return_tensors="pt")
    pixels = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, resample=3,
                                image_mean=[0.48145466, 0.4578275, 0.40821073],
                                image_std=[0.26862954, 0.26130258, 0.27577711])(images=list(images),
                                                                                return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        want = _image_reward_reference(sd, pixels, text["input_ids"], text["attention_mask"]).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
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
