"""BAGEL's autoencoder (jaxflow_bridge/families/bagel/vae.py): the key map between FLUX's `ae.safetensors` names and
diffusers' Encoder / Decoder, and the decode against FLUX's decoder written out here from the checkpoint's names."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from jaxflow_bridge.families.bagel import vae as bv

SMALL = dict(bv.AE_PARAMS, ch=32, ch_mult=(1, 2, 2, 2), num_res_blocks=1)  # 4 levels (8x), GroupNorm(32)-sized
U = 2.0**-24


def random_checkpoint(params, seed=0) -> dict[str, torch.Tensor]:
    g, out = torch.Generator().manual_seed(seed), {}
    for name, shape in bv.checkpoint_shapes(params).items():
        if name.endswith(".bias") or len(shape) == 1:
            out[name] = (1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(*shape, generator=g)
        else:
            out[name] = torch.randn(*shape, generator=g) / math.sqrt(math.prod(shape[1:]))
    return out


def flux_decode(sd, latents, grid_hw, params, patch=2):
    """FLUX's decoder (vLLM-Omni's `AutoEncoder.decode`) and BagelPipeline's unpatchify, from the checkpoint's names."""
    def conv(x, name, **kw):
        return F.conv2d(x, sd[f"{name}.weight"], sd[f"{name}.bias"], **kw)

    def norm(x, name):
        return F.group_norm(x, 32, sd[f"{name}.weight"], sd[f"{name}.bias"], eps=1e-6)

    def resnet(x, name):
        h = conv(F.silu(norm(x, f"{name}.norm1")), f"{name}.conv1", padding=1)
        h = conv(F.silu(norm(h, f"{name}.norm2")), f"{name}.conv2", padding=1)
        return (conv(x, f"{name}.nin_shortcut") if f"{name}.nin_shortcut.weight" in sd else x) + h

    def attention(x, name):
        h = norm(x, f"{name}.norm")
        b, c, hh, ww = h.shape
        q, k, v = (conv(h, f"{name}.{t}").reshape(b, 1, c, hh * ww).transpose(2, 3) for t in "qkv")
        out = F.scaled_dot_product_attention(q, k, v).transpose(2, 3).reshape(b, c, hh, ww)
        return x + conv(out, f"{name}.proj_out")

    (gh, gw), z = grid_hw, params["z_channels"]
    x = latents.reshape(-1, gh, gw, patch, patch, z).permute(0, 5, 1, 3, 2, 4).reshape(-1, z, gh * patch, gw * patch)
    h = conv(x / params["scale_factor"] + params["shift_factor"], "decoder.conv_in", padding=1)
    h = resnet(attention(resnet(h, "decoder.mid.block_1"), "decoder.mid.attn_1"), "decoder.mid.block_2")
    for i in reversed(range(len(params["ch_mult"]))):
        for j in range(params["num_res_blocks"] + 1):
            h = resnet(h, f"decoder.up.{i}.block.{j}")
        if i:
            h = conv(F.interpolate(h, scale_factor=2.0, mode="nearest"), f"decoder.up.{i}.upsample.conv", padding=1)
    return conv(F.silu(norm(h, "decoder.norm_out")), "decoder.conv_out", padding=1)


def test_the_key_map_names_every_tensor_of_vllm_omnis_autoencoder_once():
    shapes = bv.checkpoint_shapes()
    assert round(sum(math.prod(s) for s in shapes.values()) / 1e6, 1) == 83.8  # the 84M FLUX AE, encoder + decoder
    assert shapes["encoder.conv_out.weight"] == (32, 512, 3, 3)  # mean and log-variance of 16 channels
    assert shapes["decoder.mid.attn_1.q.weight"] == (512, 512, 1, 1) and shapes["decoder.conv_in.weight"][1] == 16
    assert shapes["decoder.up.0.block.0.nin_shortcut.weight"] == (128, 256, 1, 1)  # up.0: the last level applied
    assert "decoder.up.3.upsample.conv.weight" in shapes and "decoder.up.0.upsample.conv.weight" not in shapes
    assert "encoder.down.0.downsample.conv.weight" in shapes and "encoder.down.3.downsample.conv.weight" not in shapes
    modules = bv.module_map()
    assert len(set(modules.values())) == len(modules)
    with pytest.raises(ValueError, match="not in the BAGEL autoencoder's key map"):
        bv.to_checkpoint_name("decoder.up_blocks.9.resnets.0.conv1.weight", modules)


def test_decode_matches_fluxs_decoder_written_from_the_checkpoint_names():
    sd = random_checkpoint(SMALL)
    decoder = bv.BagelDecoder(sd, SMALL)
    latents = torch.randn(2, 2 * 3, 64, generator=torch.Generator().manual_seed(1))
    got = decoder.pixels(latents, (2, 3))
    with torch.no_grad():
        want = flux_decode(sd, latents, (2, 3), SMALL)
    assert got.shape == want.shape == (2, 3, 32, 48)
    # the same float32 ops, but attention's 1x1 convs as matmuls: sums of up to 9 x 128 terms in another order
    # at each of ~20 layers, ~sqrt(terms) ulps of the output's scale apiece
    bound = 20 * math.sqrt(9 * 128) * U * float(want.abs().max())
    assert float((got - want).abs().max()) <= bound
    # a wrong patch order (h and w swapped inside a token) is far outside it
    swapped = latents.reshape(2, 2, 3, 2, 2, 16).transpose(3, 4).reshape(2, 6, 64)
    assert float((decoder.pixels(swapped, (2, 3)) - want).abs().max()) > 100 * bound
    images = decoder(latents, (2, 3))
    assert images.dtype == np.uint8 and images.shape == (2, 32, 48, 3)
    np.testing.assert_array_equal(images, ((got * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 1) * 255).to(torch.uint8))


def test_a_checkpoint_missing_a_decoder_tensor_is_refused_by_name():
    sd = random_checkpoint(SMALL)
    del sd["decoder.mid.attn_1.v.bias"]
    with pytest.raises(ValueError, match="ae.safetensors lacks decoder.mid.attn_1.v.bias"):
        bv.BagelDecoder(sd, SMALL)
