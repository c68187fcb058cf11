"""ImageReward (Xu et al. 2023; flow_grpo's `imagereward` reward): BLIP's ViT-L image tokens cross-attended by its
BERT text encoder, the [CLS] output through an MLP 768-1024-128-64-16-1, then (r - 0.16717362830052426) /
1.0333394966054072, as the ImageReward package's `score` computes it (prompt padded to 35 tokens; the image through OpenAI CLIP's
torchvision transform, `preprocess.Pixels` "round": resized to 224 on its short side with bicubic resampling,
centre-cropped as torchvision crops, normalised with OpenAI CLIP's mean and std).

The checkpoint (`ImageReward.pt`: the keys of its `blip.visual_encoder`, `blip.text_encoder`, `blip.vision_proj`,
`blip.text_proj` and `mlp`) runs as transformers' `BlipVisionModel` and `BlipTextModel` through `KEYS`; the
contrastive projections are not used by the score. Options: `path` (ImageReward.pt), `med_config` (its
med_config.json: the text encoder's sizes), `tokenizer_path` (a bert-base-uncased folder: vocab.txt,
tokenizer_config.json), device, dtype (float32 by default), batch_size; `vision` overrides the ViT-L sizes (VIT_L).
Never imports JAX.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from jaxflow_bridge.rewards.models.clip import OPENAI_MEAN, OPENAI_STD, AestheticMLP, require_files
from jaxflow_bridge.rewards.models.preprocess import Pixels

MEAN, STD = 0.16717362830052426, 1.0333394966054072  # ImageReward's normalisation of the MLP's output
MAX_TOKENS = 35
# BLIP's create_vit('large', 224): patch 16, width 1024, 24 blocks, 16 heads, MLP 4096, LayerNorm eps 1e-6
VIT_L = dict(image_size=224, patch_size=16, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
             intermediate_size=4096)

# ImageReward key (regex) -> (module, key in it); the text encoder's names are BlipTextModel's own
KEYS = (
    (r"blip\.visual_encoder\.cls_token", "vision", "embeddings.class_embedding"),
    (r"blip\.visual_encoder\.pos_embed", "vision", "embeddings.position_embedding"),
    (r"blip\.visual_encoder\.patch_embed\.proj\.(weight|bias)", "vision", r"embeddings.patch_embedding.\1"),
    (r"blip\.visual_encoder\.blocks\.(\d+)\.norm1\.(weight|bias)", "vision", r"encoder.layers.\1.layer_norm1.\2"),
    (r"blip\.visual_encoder\.blocks\.(\d+)\.norm2\.(weight|bias)", "vision", r"encoder.layers.\1.layer_norm2.\2"),
    (r"blip\.visual_encoder\.blocks\.(\d+)\.attn\.qkv\.(weight|bias)", "vision", r"encoder.layers.\1.self_attn.qkv.\2"),
    (r"blip\.visual_encoder\.blocks\.(\d+)\.attn\.proj\.(weight|bias)", "vision",
     r"encoder.layers.\1.self_attn.projection.\2"),
    (r"blip\.visual_encoder\.blocks\.(\d+)\.mlp\.(fc1|fc2)\.(weight|bias)", "vision", r"encoder.layers.\1.mlp.\2.\3"),
    (r"blip\.visual_encoder\.norm\.(weight|bias)", "vision", r"post_layernorm.\1"),
    # BERT's position_ids buffer (0..max_position-1), saved in the released state dicts; BlipTextModel makes its own
    (r"blip\.text_encoder\.embeddings\.position_ids", None, None),
    (r"blip\.text_encoder\.(.+)", "text", r"\1"),
    (r"mlp\.(layers\.\d+\.(?:weight|bias))", "mlp", r"\1"),
    (r"blip\.(?:vision_proj|text_proj)\..+", None, None),  # the contrastive heads: not part of the score
)


def split_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """ImageReward's state dict as {"vision", "text", "mlp"} state dicts; ValueError naming keys it does not know."""
    out, unknown = {"vision": {}, "text": {}, "mlp": {}}, []
    rules = [(re.compile(p + "$"), part, target) for p, part, target in KEYS]
    for key, value in state.items():
        for pattern, part, target in rules:
            match = pattern.match(key)
            if match:
                if part:
                    out[part][match.expand(target)] = value
                break
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"reward 'image_reward': {len(unknown)} keys of the checkpoint are not ImageReward's, e.g. "
                         f"{unknown[:3]}")
    return out


class ImageReward:
    name = "image_reward"
    splittable = True

    def __init__(self, path=None, med_config=None, tokenizer_path=None, device: str = "cpu", dtype: str = "float32",
                 batch_size: int = 16, vision: dict | None = None):
        from transformers import BertTokenizer, BlipTextConfig, BlipVisionConfig, BlipVisionModel
        from transformers.models.blip.modeling_blip_text import BlipTextModel

        for key, value, what in (("path", path, "the checkpoint (ImageReward.pt)"),
                                 ("med_config", med_config, "its text encoder's med_config.json")):
            if not value or not Path(value).is_file():
                raise FileNotFoundError(f"reward 'image_reward' needs reward.options.image_reward.{key}: {what}, "
                                        f"got {value!r}")
        folder = require_files(self.name, "tokenizer_path", tokenizer_path, ("vocab.txt",))
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"reward 'image_reward': dtype {dtype!r}; choose float32, bfloat16 or float16")
        self.device, self.dtype, self.batch_size = torch.device(device), getattr(torch, dtype), int(batch_size)
        med = json.loads(Path(med_config).read_text())
        v = {**VIT_L, **(vision or {})}
        self.vision = BlipVisionModel(BlipVisionConfig(**v, hidden_act="gelu", layer_norm_eps=1e-6))
        self.text = BlipTextModel(BlipTextConfig(
            vocab_size=med["vocab_size"], hidden_size=med["hidden_size"], num_hidden_layers=med["num_hidden_layers"],
            num_attention_heads=med["num_attention_heads"], intermediate_size=med["intermediate_size"],
            max_position_embeddings=med["max_position_embeddings"], layer_norm_eps=med["layer_norm_eps"],
            hidden_act=med.get("hidden_act", "gelu"), encoder_hidden_size=v["hidden_size"], is_decoder=True,
            bos_token_id=None, sep_token_id=None, pad_token_id=med.get("pad_token_id", 0)), add_pooling_layer=False)
        self.mlp = AestheticMLP(med["hidden_size"])  # the same MLP (keys layers.{0,2,4,6,7}) as the aesthetic one
        parts = split_checkpoint(torch.load(path, map_location="cpu", weights_only=True))
        for part, module in (("vision", self.vision), ("text", self.text), ("mlp", self.mlp)):
            missing, unexpected = module.load_state_dict(parts[part], strict=False)
            missing = [k for k in missing if not k.endswith("position_ids")]
            if missing or unexpected:
                raise ValueError(f"reward 'image_reward': {path} does not fit ({part}: missing {missing[:3]}, "
                                 f"unexpected {unexpected[:3]}); check med_config and reward.options.image_reward"
                                 f".vision")
            module.eval().to(self.device, self.dtype)
        # BLIP's tokenizer: bert-base-uncased plus [DEC] as bos and [ENC] (ids 30522, 30523 in a 30524 vocabulary)
        self.tokenizer = BertTokenizer.from_pretrained(folder, local_files_only=True)
        self.tokenizer.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
        self.pixels = Pixels(v["image_size"], OPENAI_MEAN, OPENAI_STD, "round")

    def score(self, images: np.ndarray, prompts: Sequence[str]) -> torch.Tensor:
        image = self.vision(pixel_values=self.pixels(images).to(self.device, self.dtype)).last_hidden_state
        tok = self.tokenizer(list(prompts), padding="max_length", truncation=True, max_length=MAX_TOKENS,
                             return_tensors="pt").to(self.device)
        text = self.text(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"],
                         encoder_hidden_states=image,
                         encoder_attention_mask=torch.ones(image.shape[:2], dtype=torch.long, device=self.device))
        return (self.mlp(text.last_hidden_state[:, 0]).squeeze(-1).float() - MEAN) / STD

    @torch.inference_mode()
    def __call__(self, images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
        if len(images) != len(prompts):
            raise ValueError(f"reward 'image_reward': {len(images)} images but {len(prompts)} prompts")
        out = [self.score(images[i:i + self.batch_size], list(prompts[i:i + self.batch_size]))
               for i in range(0, len(images), self.batch_size)]
        return torch.cat(out).cpu().numpy().astype(np.float32) if out else np.zeros(0, np.float32)
