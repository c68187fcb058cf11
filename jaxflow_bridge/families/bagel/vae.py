"""BAGEL's image autoencoder (FLUX's `ae.safetensors`, docs/bagel.md §6) as diffusers' Encoder / Decoder: the key
map between the checkpoint's names (what vLLM-Omni's `AutoEncoder` loads) and diffusers', and the decode of a
trajectory's final latents to images as vLLM-Omni's BagelPipeline does it. Never imports JAX.

Geometry: vLLM-Omni hard-codes `default_ae_params` (ch 128, ch_mult (1, 2, 4, 4), 2 res blocks, z 16, scale 0.3611,
shift 0.1159), so every BAGEL folder carries that AE, the tiny one too. Names: `{encoder,decoder}.conv_in`,
`.down.{i}.block.{j}` / `.up.{i}.block.{j}` (ResnetBlock: norm1, conv1, norm2, conv2, nin_shortcut),
`.down.{i}.downsample.conv`, `.up.{i}.upsample.conv`, `.mid.block_{1,2}`, `.mid.attn_1` (norm, q, k, v, proj_out:
1x1 convs), `.norm_out`, `.conv_out`. FLUX's up blocks are listed by resolution (`up.0` is the last applied),
diffusers' in order of application; its attention projections are Linears ((C, C) for FLUX's (C, C, 1, 1)).
"""
from __future__ import annotations

import numpy as np
import torch
from diffusers.models.autoencoders.vae import Decoder, Encoder

AE_PARAMS = dict(ch=128, ch_mult=(1, 2, 4, 4), num_res_blocks=2, z_channels=16, scale_factor=0.3611,
                 shift_factor=0.1159)
RESNET = {"norm1": "norm1", "conv1": "conv1", "norm2": "norm2", "conv2": "conv2", "nin_shortcut": "conv_shortcut"}
ATTENTION = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}


def module_map(ch_mult=AE_PARAMS["ch_mult"], num_res_blocks=AE_PARAMS["num_res_blocks"]) -> dict[str, str]:
    """Checkpoint module -> (diffusers side, module) as "encoder.<name>" / "decoder.<name>" on both sides."""
    levels, out = len(ch_mult), {}
    for side in ("encoder", "decoder"):
        out.update({f"{side}.conv_in": f"{side}.conv_in", f"{side}.norm_out": f"{side}.conv_norm_out",
                    f"{side}.conv_out": f"{side}.conv_out", f"{side}.mid.block_1": f"{side}.mid_block.resnets.0",
                    f"{side}.mid.block_2": f"{side}.mid_block.resnets.1",
                    f"{side}.mid.attn_1": f"{side}.mid_block.attentions.0"})
    for i in range(levels):
        for j in range(num_res_blocks):
            out[f"encoder.down.{i}.block.{j}"] = f"encoder.down_blocks.{i}.resnets.{j}"
        if i < levels - 1:
            out[f"encoder.down.{i}.downsample.conv"] = f"encoder.down_blocks.{i}.downsamplers.0.conv"
        up = f"decoder.up_blocks.{levels - 1 - i}"
        for j in range(num_res_blocks + 1):
            out[f"decoder.up.{i}.block.{j}"] = f"{up}.resnets.{j}"
        if i:
            out[f"decoder.up.{i}.upsample.conv"] = f"{up}.upsamplers.0.conv"
    return out


def to_checkpoint_name(name: str, modules: dict[str, str]) -> str:
    """A diffusers "encoder.|decoder." parameter name -> the checkpoint's; ValueError for a name off the map."""
    inverse = {v: k for k, v in modules.items()}
    module, leaf = name, ""
    while module and module not in inverse:
        module, _, last = module.rpartition(".")
        leaf = f"{last}.{leaf}" if leaf else last
    if not module:
        raise ValueError(f"{name}: not in the BAGEL autoencoder's key map")
    part, _, kind = leaf.rpartition(".")  # kind: weight | bias
    if ".resnets." in module and part:
        part = {v: k for k, v in RESNET.items()}[part]
    elif ".attentions." in module:
        part = {v: k for k, v in ATTENTION.items()}[part]
    return ".".join(p for p in (inverse[module], part, kind) if p)


def networks(params: dict = AE_PARAMS) -> dict[str, torch.nn.Module]:
    """diffusers' Encoder and Decoder at the checkpoint's geometry (float32, CPU)."""
    levels = len(params["ch_mult"])
    channels = tuple(params["ch"] * m for m in params["ch_mult"])
    common = dict(block_out_channels=channels, layers_per_block=params["num_res_blocks"], norm_num_groups=32,
                  act_fn="silu")
    return {"encoder": Encoder(in_channels=3, out_channels=params["z_channels"], double_z=True,
                               down_block_types=("DownEncoderBlock2D",) * levels, **common),
            "decoder": Decoder(in_channels=params["z_channels"], out_channels=3,
                               up_block_types=("UpDecoderBlock2D",) * levels, **common)}


def checkpoint_shapes(params: dict = AE_PARAMS) -> dict[str, tuple[int, ...]]:
    """Every tensor of `ae.safetensors` by the checkpoint's name, with its shape."""
    with torch.device("meta"):
        nets = networks(params)
    modules = module_map(params["ch_mult"], params["num_res_blocks"])
    out = {}
    for side, net in nets.items():
        for name, t in net.state_dict().items():
            key = to_checkpoint_name(f"{side}.{name}", modules)
            out[key] = tuple(t.shape) + ((1, 1) if ".attn_1." in key and key.endswith("weight") and t.ndim == 2
                                         else ())
    return out


class BagelDecoder:
    """Final latents (B, S, p * p * z) on an (h, w) token grid -> uint8 images (B, 16 h, 16 w, 3), as vLLM-Omni's
    `_decode_image_from_latent`: unpatchify (token row-major, then p x p x z), z / scale + shift, the decoder,
    (x / 2 + 1/2) clamped to [0, 1] times 255, truncated to uint8."""

    def __init__(self, tensors: dict[str, torch.Tensor], params: dict = AE_PARAMS, patch: int = 2):
        self.params, self.patch = params, patch
        self.net = networks(params)["decoder"].eval()
        modules = module_map(params["ch_mult"], params["num_res_blocks"])
        state = {}
        for name, t in self.net.state_dict().items():
            key = to_checkpoint_name(f"decoder.{name}", modules)
            if key not in tensors:
                raise ValueError(f"ae.safetensors lacks {key}: pass a BAGEL folder's FLUX autoencoder")
            state[name] = tensors[key].to(torch.float32).reshape(t.shape)
        self.net.load_state_dict(state, strict=True)

    @torch.inference_mode()
    def pixels(self, latents: torch.Tensor, grid_hw: tuple[int, int]) -> torch.Tensor:
        """The decoder's float32 output (B, 3, 16 h, 16 w), about [-1, 1]."""
        (h, w), p, z = grid_hw, self.patch, self.params["z_channels"]
        x = latents.to(torch.float32).reshape(-1, h, w, p, p, z)
        x = torch.einsum("nhwpqc->nchpwq", x).reshape(-1, z, h * p, w * p)
        return self.net(x / self.params["scale_factor"] + self.params["shift_factor"])

    def __call__(self, latents: torch.Tensor, grid_hw: tuple[int, int]) -> np.ndarray:
        image = (self.pixels(latents, grid_hw) * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 1) * 255
        return image.to(torch.uint8).numpy()
