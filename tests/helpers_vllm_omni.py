"""A stand-in of vLLM-Omni's fused Qwen-Image transformer (module tree and layer sizes only), sized like
tests/helpers.py's random_peft (width D, MLP width MLP, LAYERS blocks)."""
import torch

from tests.helpers import LAYERS, MLP, D


_WEIGHTS = torch.Generator().manual_seed(0)


class FakeLinearBase(torch.nn.Module):
    """vLLM's LinearBase as the table sees it: input_size, output_size, and output_sizes when fused; a bf16 weight
    (out, in) drawn from one seeded generator (a fresh tree in a fresh process holds the same values)."""

    def __init__(self, fan_in: int, *outs: int):
        super().__init__()
        self.input_size, self.output_size = fan_in, sum(outs)
        if len(outs) > 1:
            self.output_sizes = list(outs)
        weight = torch.randn(sum(outs), fan_in, generator=_WEIGHTS) * fan_in ** -0.5
        self.weight = torch.nn.Parameter(weight.to(torch.bfloat16), requires_grad=False)


def _mlp() -> torch.nn.Module:
    gelu = torch.nn.Module()
    gelu.proj = FakeLinearBase(D, MLP)
    mlp = torch.nn.Module()
    mlp.net = torch.nn.ModuleList([gelu, torch.nn.Identity(), FakeLinearBase(MLP, D)])
    return mlp


class FakeFusedTransformer(torch.nn.Module):
    """Module tree of vLLM-Omni 0.20's QwenImageTransformer2DModel: fused to_qkv / add_kv_proj, `to_out`."""

    packed_modules_mapping = {"to_qkv": ["to_q", "to_k", "to_v"], "add_kv_proj": ["add_q_proj", "add_k_proj",
                                                                                  "add_v_proj"]}

    def __init__(self, kv: int = D):
        super().__init__()
        self.img_in, self.txt_in, self.proj_out = FakeLinearBase(64, D), FakeLinearBase(16, D), FakeLinearBase(D, 64)
        blocks = []
        for _ in range(LAYERS):
            block = torch.nn.Module()
            block.attn = torch.nn.Module()
            block.attn.to_qkv, block.attn.add_kv_proj = FakeLinearBase(D, D, kv, kv), FakeLinearBase(D, D, kv, kv)
            block.attn.to_out, block.attn.to_add_out = FakeLinearBase(D, D), FakeLinearBase(D, D)
            block.attn.norm_q = torch.nn.RMSNorm(D)
            block.img_mod = torch.nn.Sequential(torch.nn.SiLU(), FakeLinearBase(D, 6 * D))
            block.txt_mod = torch.nn.Sequential(torch.nn.SiLU(), FakeLinearBase(D, 6 * D))
            block.img_mlp, block.txt_mlp = _mlp(), _mlp()
            blocks.append(block)
        self.transformer_blocks = torch.nn.ModuleList(blocks)
