"""HPS v2.1 (Wu et al. 2023, "Human Preference Score v2"): cos(image, text) of an open_clip ViT-H-14 fine-tuned on
human preferences (flow_grpo's `hpsv2` reward; the hpsv2 package's `score`, which reads the diagonal of
image_features @ text_features.T of the normalised features).

The checkpoint (`HPS_v2.1_compressed.pt`: {"state_dict": open_clip CLIP keys}) runs as transformers' `CLIPModel`:
`open_clip_to_clip` renames its keys (`KEYS`) and splits each attention's fused in-projection into q, k and v, so
no open_clip (nor its torchvision) is needed. Its inputs are hpsv2's: the image letterboxed (`preprocess.Pixels`
"letterbox": the long side to 224, black padding, no crop), the prompt cleaned as open_clip's tokenizer cleans it
(`preprocess.clean_prompt`: ftfy's fixes, HTML unescaping, whitespace) before the CLIP BPE, 77 tokens (a longer
prompt keeps its end-of-text token last). The processor folder is the ViT-H-14 one of transformers
(laion/CLIP-ViT-H-14-laion2B-s32B-b79K: its size, OpenAI's mean and std, the CLIP BPE vocabulary), as PickScore's.
Options: `path` (the .pt file), `processor_path` (that folder), device, dtype (float32 by default; hpsv2 scores
under float16 autocast on a GPU), batch_size; `arch` overrides the ViT-H-14 sizes (VIT_H_14). Never imports JAX.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from jaxflow_bridge.rewards.models.clip import ClipReward
from jaxflow_bridge.rewards.models.preprocess import clean_prompt

# open_clip's ViT-H-14 (model_configs/ViT-H-14.json): image 224, patch 14, width 1280, 32 layers, head width 80;
# text width 1024, 16 heads, 24 layers, 77 tokens, vocabulary 49408; embeddings 1024; GELU; LayerNorm eps 1e-5
VIT_H_14 = dict(
    vision=dict(image_size=224, patch_size=14, hidden_size=1280, num_hidden_layers=32, num_attention_heads=16,
                intermediate_size=5120),
    text=dict(vocab_size=49408, max_position_embeddings=77, hidden_size=1024, num_hidden_layers=24,
              num_attention_heads=16, intermediate_size=4096, bos_token_id=49406, eos_token_id=49407),
    projection_dim=1024)

# open_clip key (regex) -> CLIPModel key; "{t}" is a tower's prefix pair (visual.transformer / vision_model, ...)
KEYS = (
    (r"visual\.conv1\.weight", "vision_model.embeddings.patch_embedding.weight"),
    (r"visual\.class_embedding", "vision_model.embeddings.class_embedding"),
    (r"visual\.positional_embedding", "vision_model.embeddings.position_embedding.weight"),
    (r"visual\.ln_pre\.(weight|bias)", r"vision_model.pre_layrnorm.\1"),
    (r"visual\.ln_post\.(weight|bias)", r"vision_model.post_layernorm.\1"),
    (r"token_embedding\.weight", "text_model.embeddings.token_embedding.weight"),
    (r"positional_embedding", "text_model.embeddings.position_embedding.weight"),
    (r"ln_final\.(weight|bias)", r"text_model.final_layer_norm.\1"),
    (r"logit_scale", "logit_scale"),
    # per block, both towers
    (r"{t}\.resblocks\.(\d+)\.ln_1\.(weight|bias)", r"{h}.encoder.layers.\1.layer_norm1.\2"),
    (r"{t}\.resblocks\.(\d+)\.ln_2\.(weight|bias)", r"{h}.encoder.layers.\1.layer_norm2.\2"),
    (r"{t}\.resblocks\.(\d+)\.attn\.out_proj\.(weight|bias)", r"{h}.encoder.layers.\1.self_attn.out_proj.\2"),
    (r"{t}\.resblocks\.(\d+)\.mlp\.c_fc\.(weight|bias)", r"{h}.encoder.layers.\1.mlp.fc1.\2"),
    (r"{t}\.resblocks\.(\d+)\.mlp\.c_proj\.(weight|bias)", r"{h}.encoder.layers.\1.mlp.fc2.\2"),
    # the fused in-projection, split into q, k, v below
    (r"{t}\.resblocks\.(\d+)\.attn\.in_proj_(weight|bias)", r"{h}.encoder.layers.\1.self_attn.{}_proj.\2"),
)
TOWERS = (("visual.transformer", "vision_model"), ("transformer", "text_model"))
# open_clip applies these as x @ proj; CLIPModel's projections are Linear layers (weight = proj.T)
PROJECTIONS = {"visual.proj": "visual_projection.weight", "text_projection": "text_projection.weight"}


def _rules() -> list[tuple[re.Pattern, str]]:
    rules = []
    for pattern, target in KEYS:
        towers = TOWERS if "{t}" in pattern else ((None, None),)
        for ours, theirs in towers:
            p = pattern.replace("{t}", re.escape(ours)) if ours else pattern
            rules.append((re.compile(p + r"$"), target.replace("{h}", theirs) if theirs else target))
    return rules


def open_clip_to_clip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An open_clip CLIP state dict as CLIPModel's; ValueError naming keys it does not know."""
    out, unknown, rules = {}, [], _rules()
    for key, value in state.items():
        if key in PROJECTIONS:
            out[PROJECTIONS[key]] = value.t().contiguous()
            continue
        for pattern, target in rules:
            match = pattern.match(key)
            if match:
                name = match.expand(target)
                if "{}" in name:  # in_proj: rows [q; k; v]
                    for part, chunk in zip("qkv", value.chunk(3, dim=0)):
                        out[name.format(part)] = chunk.contiguous()
                else:
                    out[name] = value
                break
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"reward 'hps': {len(unknown)} keys of the checkpoint are not open_clip CLIP keys, e.g. "
                         f"{unknown[:3]}")
    return out


def clip_config(arch: dict, **extra):
    """transformers' CLIPConfig of an open_clip CLIP at `arch` (VIT_H_14's layout): GELU, LayerNorm eps 1e-5, the
    end-of-text token padding; `extra`: further CLIPConfig fields."""
    from transformers import CLIPConfig

    return CLIPConfig(vision_config={**arch["vision"], "hidden_act": "gelu", "layer_norm_eps": 1e-5},
                      text_config={**arch["text"], "hidden_act": "gelu", "layer_norm_eps": 1e-5,
                                   "pad_token_id": arch["text"]["eos_token_id"]},
                      projection_dim=arch["projection_dim"], **extra)


class Hps(ClipReward):
    name = "hps"
    crop = "letterbox"

    def __init__(self, path=None, processor_path=None, device: str = "cpu", dtype: str = "float32",
                 batch_size: int = 16, arch: dict | None = None):
        if not path or not Path(path).is_file():
            raise FileNotFoundError(f"reward 'hps' needs reward.options.hps.path: the HPS v2.1 checkpoint "
                                    f"(HPS_v2.1_compressed.pt), got {path!r}")
        if not processor_path:
            raise FileNotFoundError("reward 'hps' needs reward.options.hps.processor_path: a CLIP ViT-H-14 processor "
                                    "folder (laion/CLIP-ViT-H-14-laion2B-s32B-b79K's preprocessor and tokenizer files)")
        self.checkpoint, self.arch = Path(path), {**VIT_H_14, **(arch or {})}
        super().__init__(path, processor_path, device, dtype, batch_size)

    def require_model(self, path) -> None:
        """Checked in __init__: the checkpoint is one file, not a folder."""

    def load_model(self, path, dtype: torch.dtype):
        from transformers import CLIPModel

        with torch.device("meta"):  # no random weights drawn: the checkpoint's replace every one
            model = CLIPModel(clip_config(self.arch))
        state = torch.load(self.checkpoint, map_location="cpu", weights_only=True)
        state = open_clip_to_clip(state.get("state_dict", state))
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        missing = [k for k in missing if not k.endswith("position_ids")]
        if missing or unexpected:
            raise ValueError(f"reward 'hps': {self.checkpoint} does not fit the CLIP of reward.options.hps.arch: "
                             f"missing {missing[:3]}, unexpected {unexpected[:3]}")
        for name, buffer in list(model.named_buffers()):  # the position ids: no checkpoint holds them
            owner, _, leaf = name.rpartition(".")
            if buffer.is_meta and leaf == "position_ids":
                model.get_submodule(owner).register_buffer(
                    leaf, torch.arange(buffer.shape[-1]).expand(buffer.shape), persistent=False)
        empty = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
        if empty:
            raise ValueError(f"reward 'hps': {self.checkpoint} leaves {empty[:3]} of the CLIP of "
                             f"reward.options.hps.arch unset")
        return model.to(dtype)

    def score(self, images, prompts):
        image, text = self.embed(images, [clean_prompt(p) for p in prompts])
        return (image * text).sum(-1)
