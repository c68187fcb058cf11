"""A tiny, deterministic, offline Qwen-Image pipeline folder in diffusers format.

The folder loads with ``QwenImagePipeline.from_pretrained`` and exercises the real code paths: the 34-token
template drop, prompt masks, true CFG, dynamic shift with ``shift_terminal``, 16-channel packing and the real
VAE latent statistics. Nothing is downloaded: every component is built from a seeded config.

Seeds: ``torch.manual_seed(seed + k)`` before component k (0 transformer, 1 VAE, 2 text encoder).

Tokenizer: a byte-level BPE whose vocab is the 256 GPT-2 byte characters, one chained merge per prefix of each
word of the prompt template (so every template word is one token, as in the real Qwen2 vocab), then the 14 Qwen
special tokens and the 4 fill-in-the-middle tokens (added, not special, as in Qwen2.5's tokenizer; vLLM-Omni's BAGEL
thinker marks an image to edit with ``<|fim_middle|>``), all in their real relative order. Other text falls back to
bytes. ``vocab_size`` is that count rounded up to 64 (384), instead of the real 152064, which keeps the text encoder
at about 0.1M params.

CLI: ``python -m jaxflow_bridge.families.qwen_image.tiny --out DIR [--seed 0] [--dtype float32]``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from tokenizers import Regex, pre_tokenizers
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from jaxflow_bridge.rollout.model_cache import DTYPES, cached_folder, check_dtype, folder_cli

FORMAT_VERSION = 2  # 2: the fill-in-the-middle tokens

PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
TEMPLATE_DROP = 34  # tokens before the user prompt; diffusers' prompt_template_encode_start_idx

TINY_TRANSFORMER_CONFIG = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=2,
    attention_head_dim=32,
    num_attention_heads=2,
    joint_attention_dim=64,
    guidance_embeds=False,
    axes_dims_rope=(8, 12, 12),
)

TINY_VAE_CONFIG = dict(
    base_dim=32,
    z_dim=16,
    dim_mult=[1, 2, 4],
    num_res_blocks=1,
    temperal_downsample=[False, True],
    latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                  0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
    latents_std=[2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                 3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160],
)

# The released Qwen/Qwen-Image scheduler config.
QWEN_SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=0.9,
    base_image_seq_len=256,
    max_image_seq_len=8192,
    shift_terminal=0.02,
    time_shift_type="exponential",
    invert_sigmas=False,
    stochastic_sampling=False,
    use_karras_sigmas=False,
    use_exponential_sigmas=False,
    use_beta_sigmas=False,
)

TINY_TEXT_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    rms_norm_eps=1e-6,
    rope_scaling={"mrope_section": [4, 6, 6], "rope_type": "default", "type": "default"},
    rope_theta=1e6,
)
TINY_VISION_CONFIG = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=64)

# Qwen2 special tokens, in the order of their real ids 151643..151656.
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
# Qwen2.5's added (not special) fill-in-the-middle tokens, in the order of their real ids 151659..151662.
QWEN_FIM_TOKENS = ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>")


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable-character map, indexed by byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _template_words(templates: tuple[str, ...]) -> list[str]:
    """Byte-level words of the templates (user and assistant turns included), split as Qwen2 splits them."""
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    special = "|".join(re.escape(t) for t in QWEN_SPECIAL_TOKENS)
    texts = [re.sub(special, "\0", t.format("")) for t in templates]
    words = [w for text in texts for piece in text.split("\0") for w, _ in pre.pre_tokenize_str(piece)]
    return list(dict.fromkeys(words))


def tokenizer_vocab(templates: tuple[str, ...] = (PROMPT_TEMPLATE,)) -> tuple[dict[str, int], list[tuple[str, str]],
                                                                               int]:
    """(vocab, merges, vocab_size): bytes, chained merges of the `templates`' words, then Qwen's special and FIM
    tokens."""
    vocab = {c: i for i, c in enumerate(_byte_alphabet())}
    merges = []
    for word in _template_words(templates):
        for k in range(1, len(word)):
            if word[: k + 1] not in vocab:
                merges.append((word[:k], word[k]))
                vocab[word[: k + 1]] = len(vocab)
    for tok in (*QWEN_SPECIAL_TOKENS, *QWEN_FIM_TOKENS):
        vocab[tok] = len(vocab)
    return vocab, merges, -(-len(vocab) // 64) * 64


def build_tokenizer(templates: tuple[str, ...] = (PROMPT_TEMPLATE,)):
    """A Qwen2Tokenizer whose template prefix tokenizes to exactly ``TEMPLATE_DROP`` tokens (every word of the
    `templates` one token); each FIM token is one added token of its vocab id."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab, merges, _ = tokenizer_vocab(templates)
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        extra_special_tokens=list(QWEN_SPECIAL_TOKENS[1:]),
        padding_side="right",
        model_max_length=32768,
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_FIM_TOKENS])
    return tok


def save_slow_tokenizer_files(tok_dir: Path, templates: tuple[str, ...] = (PROMPT_TEMPLATE,)) -> None:
    """Also write vocab.json and merges.txt, as the released folder has them, for loaders that want them."""
    vocab, merges, _ = tokenizer_vocab(templates)
    (tok_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    lines = ["#version: 0.2"] + [f"{a} {b}" for a, b in merges]
    (tok_dir / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")


def text_encoder(text_config: dict, vision_config: dict, vocab_size: int | None = None,
                 templates: tuple[str, ...] = (PROMPT_TEMPLATE,)):
    """A random Qwen2_5_VLForConditionalGeneration of these configs whose token ids match :func:`build_tokenizer` of
    `templates`; `vocab_size` (at least the tokenizer's): embedding rows, for an encoder of a real one's size."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vocab, _, own = tokenizer_vocab(templates)
    if vocab_size is not None and vocab_size < own:
        raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {own}")
    vocab_size = vocab_size or own
    ids = {name: vocab[name] for name in QWEN_SPECIAL_TOKENS}
    text = dict(text_config, vocab_size=vocab_size, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def assemble(transformer, vae, encoder):
    """A ``QwenImagePipeline`` of these modules with the real scheduler config and our tokenizer: every pipeline
    this project builds (the tiny one here, the full-size random one in ``full_size.py``, the mini OCR folder)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    return QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER_CONFIG), vae=vae,
                             text_encoder=encoder, tokenizer=build_tokenizer(), transformer=transformer)


def save_folder(pipe, out_dir, **save_kw) -> Path:
    """Write ``pipe`` as a diffusers folder with the tokenizer's slow files too; returns the folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True, **save_kw)
    save_slow_tokenizer_files(out / "tokenizer")
    return out


def build_pipeline(seed: int = 0, dtype: str = "float32", transformer_config: dict | None = None, vae=None):
    """The tiny ``QwenImagePipeline`` in memory (seeded, see the module docstring); ``transformer_config`` and a
    ready ``vae`` replace the tiny ones (the mini OCR model)."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

    torch_dtype = DTYPES[dtype]
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG untouched
        torch.manual_seed(seed)
        transformer = QwenImageTransformer2DModel(**(transformer_config or TINY_TRANSFORMER_CONFIG))
        torch.manual_seed(seed + 1)
        vae = vae if vae is not None else AutoencoderKLQwenImage(**TINY_VAE_CONFIG)
        torch.manual_seed(seed + 2)
        encoder = text_encoder(TINY_TEXT_CONFIG, TINY_VISION_CONFIG)
    if torch_dtype != torch.float32:
        for module in (transformer, vae, encoder):
            module.to(torch_dtype)
    return assemble(transformer, vae, encoder)


def build_tiny_pipeline(out_dir, seed: int = 0, dtype: str = "float32") -> Path:
    """Write the tiny pipeline folder to ``out_dir``; the same (seed, dtype) gives byte-identical files."""
    check_dtype(dtype)
    return save_folder(build_pipeline(seed, dtype), out_dir)


def tiny_pipeline_path(seed: int = 0, dtype: str = "float32") -> Path:
    """The cached tiny pipeline folder, built atomically on first use and reused afterwards."""
    check_dtype(dtype)
    return cached_folder(f"qwen_image_tiny-v{FORMAT_VERSION}-seed{seed}-{dtype}", "model_index.json",
                         lambda tmp: build_tiny_pipeline(tmp, seed, dtype))


def main(argv=None) -> None:
    folder_cli(__doc__, build_tiny_pipeline, argv)


if __name__ == "__main__":
    main()
