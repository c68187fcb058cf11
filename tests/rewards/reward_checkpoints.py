"""Seeded random checkpoints in the layouts the reward models are released in (buffers included), and the
reference forwards of the ones that transformers does not implement (open_clip's CLIP, BLIP's ImageReward head),
written out from their state dicts; with a CLIP BPE vocabulary learned from a small corpus (the real one does not
ship offline: no package here carries bpe_simple_vocab_16e6.txt.gz or a CLIP vocab.json). Used by
tests/rewards/test_reward_zoo.py, test_reward_parity.py and `python -m jaxflow_bench.reward_parity`."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import regex
import torch

from tests.rewards.reference_rewards import bytes_to_unicode

HPS_ARCH = dict(vision=dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=37),
                text=dict(vocab_size=520, max_position_embeddings=77, hidden_size=24, num_hidden_layers=2,
                          num_attention_heads=2, intermediate_size=29, bos_token_id=512, eos_token_id=513),
                projection_dim=16)


def open_clip_state(arch: dict, seed: int = 3) -> dict:
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


def open_clip_features(sd: dict, arch: dict, pixels: torch.Tensor, ids: torch.Tensor):
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



IR_VISION = dict(image_size=32, patch_size=8, hidden_size=24, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=29)
IR_MED = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=27,
              max_position_embeddings=64, layer_norm_eps=1e-12, hidden_act="gelu", encoder_width=24,
              add_cross_attention=True, pad_token_id=0)
IR_WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "red", "fox", "sign", "that", "says", "hello", "two",
            "cats", "blue", "car", "the", "word", "ocr"]


def image_reward_state(v: dict, m: dict, seed: int = 5) -> dict:
    """A random state dict with ImageReward.pt's keys (BLIP's timm-style ViT, its BERT with cross-attention and its
    position_ids buffer, the contrastive projections, the MLP) at sizes `v` (BLIP ViT) and `m` (its med_config)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, base=0.0):
        return base + 0.2 * torch.randn(*shape, generator=g)

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


def image_reward_forward(sd: dict, v: dict, m: dict, pixels: torch.Tensor, ids: torch.Tensor,
                         mask: torch.Tensor) -> torch.Tensor:
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

    e = "blip.visual_encoder."
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



def write_image_reward(folder: Path, sd: dict, med: dict = IR_MED, words=IR_WORDS) -> tuple[Path, Path, Path]:
    """ImageReward.pt, its med_config.json and a BERT vocabulary folder: (path, med_config, tokenizer_path)."""
    path, med_path, tok = folder / "ImageReward.pt", folder / "med_config.json", folder / "bert-base-uncased"
    torch.save(sd, path)
    med_path.write_text(json.dumps(med))
    tok.mkdir(exist_ok=True)
    (tok / "vocab.txt").write_text("\n".join(words) + "\n")
    return path, med_path, tok


# --- a CLIP BPE vocabulary ------------------------------------------------------------------------------------------

CORPUS = ("a photograph of an astronaut riding a horse on the moon, highly detailed, 4k; a red fox sitting in the "
          "snow at sunset; a sign that says \"hello world\" in neon letters; two cats sleeping on a blue sofa; a "
          "watercolor painting of a lighthouse by the sea; the word OCR written on a blackboard with chalk; a bowl of "
          "ramen with chopsticks, studio lighting; an oil painting of a castle in the mountains, dramatic clouds; a "
          "cute corgi wearing sunglasses at the beach; a futuristic city skyline at night, cyberpunk style")


def learn_merges(corpus: str, count: int) -> list[tuple[str, str]]:
    """`count` BPE merges learned from `corpus` as CLIP's were (byte-level symbols, "</w>" closing each word,
    the most frequent pair merged first; ties broken by the pair's text)."""
    bytes_map = bytes_to_unicode()
    words = Counter(regex.findall(r"[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+", corpus.lower()))
    words = {tuple("".join(bytes_map[b] for b in w.encode())[:-1]) + ("".join(bytes_map[b] for b in w.encode())[-1]
                                                                       + "</w>",): n for w, n in words.items()}
    merges = []
    while len(merges) < count:
        pairs = Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged = {}
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] = n
        words = merged
    return merges


def write_clip_tokenizer(folder: Path, merges: list[tuple[str, str]]) -> int:
    """vocab.json and merges.txt in CLIP's layout (bytes, bytes + "</w>", the merges, then <|startoftext|> and
    <|endoftext|>), saved through transformers' CLIP tokenizer; returns the vocabulary's size."""
    from transformers import CLIPTokenizerFast

    chars = list(bytes_to_unicode().values())
    tokens = chars + [c + "</w>" for c in chars] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    CLIPTokenizerFast(str(folder / "vocab.json"), str(folder / "merges.txt"), pad_token="!").save_pretrained(folder)
    return len(tokens)


def write_clip_model(folder: Path, merges: list[tuple[str, str]], image_size: int = 32, patch_size: int = 8,
                     width: int = 32, seed: int = 0) -> Path:
    """A random CLIPModel (2 layers a tower) with the tokenizer above and a CLIP processor's preprocessor_config.json:
    the layout of PickScore_v1 / openai's clip-vit-large-patch14 folders, at a small size."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    n = write_clip_tokenizer(folder, merges)
    torch.manual_seed(seed)
    text = dict(vocab_size=n, hidden_size=width, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=77, bos_token_id=n - 2, eos_token_id=n - 1, pad_token_id=0)
    vision = dict(image_size=image_size, patch_size=patch_size, hidden_size=width, intermediate_size=37,
                  num_hidden_layers=2, num_attention_heads=2)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).save_pretrained(folder)
    CLIPImageProcessor(size={"shortest_edge": image_size},
                       crop_size={"height": image_size, "width": image_size}).save_pretrained(folder)
    return folder
