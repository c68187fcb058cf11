"""Write a PickScore folder with random weights at the real size (CLIP ViT-H-14: no download, no checkpoint).

    python scripts/make_random_pickscore.py --out DIR [--tiny]

The layout of yuvalkirstain/PickScore_v1 with its processor's files beside it (what `reward.options.pickscore.path`
reads): a bf16 `CLIPModel` (vision 1280 wide, 32 layers, patch 14, 224 px; text 1024 wide, 24 layers; embeddings
1024), CLIP's image processor settings, and a byte-level stand-in for CLIP's BPE tokenizer (every byte a token, no
merges; the real vocabulary is not available offline: prompts tokenize longer, the model costs the same per
token). --tiny writes a small float32 model of the same classes, for tests. For timing the reward in a run
(scripts/bench_reward_zoo.sh), not for its scores.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

VIT_H_14 = dict(text_config=dict(vocab_size=49408, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                 num_attention_heads=16, max_position_embeddings=77, hidden_act="gelu"),
                vision_config=dict(image_size=224, patch_size=14, hidden_size=1280, intermediate_size=5120,
                                   num_hidden_layers=32, num_attention_heads=16, hidden_act="gelu"),
                projection_dim=1024)
TINY = dict(text_config=dict(vocab_size=520, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                             num_attention_heads=2, max_position_embeddings=77),
            vision_config=dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                               num_attention_heads=2),
            projection_dim=16)


def bytes_vocab() -> dict[str, int]:
    """A byte-level BPE vocabulary without merges: every byte's character, alone and word-final, then CLIP's
    start and end tokens (ids 512, 513)."""
    chars = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(161, 173)] + [chr(c) for c in range(174, 256)]
    chars += [chr(256 + i) for i in range(256 - len(chars))]
    vocab = {t: i for i, t in enumerate(chars + [c + "</w>" for c in chars])}
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    return vocab


def write(out: Path, tiny: bool = False, seed: int = 0) -> Path:
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPTokenizer

    sizes = TINY if tiny else VIT_H_14
    vocab = bytes_vocab()
    bos, eos = vocab["<|startoftext|>"], vocab["<|endoftext|>"]
    text = {**sizes["text_config"], "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos}
    torch.manual_seed(seed)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=sizes["vision_config"],
                                 projection_dim=sizes["projection_dim"]))
    model.to(torch.float32 if tiny else torch.bfloat16).save_pretrained(out)
    px = sizes["vision_config"]["image_size"]
    CLIPImageProcessor(size={"shortest_edge": px}, crop_size={"height": px, "width": px}).save_pretrained(out)
    (out / "vocab.json").write_text(json.dumps(vocab))
    (out / "merges.txt").write_text("#version: 0.2\n")
    CLIPTokenizer(str(out / "vocab.json"), str(out / "merges.txt")).save_pretrained(out)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", action="store_true", help="a small float32 model (tests)")
    args = p.parse_args(argv)
    print(f"wrote {write(args.out, args.tiny)}")


if __name__ == "__main__":
    main()
