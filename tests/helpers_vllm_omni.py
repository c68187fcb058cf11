"""Stand-ins for vLLM-Omni's Qwen-Image side (no vLLM-Omni here).

- its fused transformer (module tree and layer sizes only), sized like tests/helpers.py's random_peft (width D, MLP
  width MLP, LAYERS blocks): FakeLinearBase, FakeFusedTransformer
- a rollout request to its pipeline (SAMPLING, SEEDS, omni_params) and its QwenImagePipeline on the tiny diffusers
  components (FakeOmniQwenImagePipeline)
"""
from types import SimpleNamespace

import torch

from jaxflow_bridge.rollout.sampling import SamplingParams
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


# ---------------------------------------------------------------------------------------------- the pipeline

SAMPLING = SamplingParams(height=16, width=24, num_inference_steps=3, true_cfg_scale=4.0, noise_level=1.2,
                          sde_window_size=1, sde_window_range=(0, 2), max_sequence_length=64, seed=5)
SEEDS = [10, 11]


def omni_params(kwargs: dict) -> SimpleNamespace:
    """Stand-in for OmniDiffusionSamplingParams built from encode_request's kwargs."""
    return SimpleNamespace(**kwargs)


class FakeOmniQwenImagePipeline(torch.nn.Module):
    """What our class uses of vLLM-Omni's QwenImagePipeline, on the tiny diffusers components."""

    def __init__(self, *, od_config, prefix=""):
        from diffusers import QwenImagePipeline

        super().__init__()
        pipe = QwenImagePipeline.from_pretrained(od_config.model, local_files_only=True)
        self.od_config, self.scheduler, self.tokenizer = od_config, pipe.scheduler, pipe.tokenizer
        self.text_encoder, self.vae, self.transformer = pipe.text_encoder, pipe.vae, pipe.transformer
        self.prompt_template_encode = pipe.prompt_template_encode
        self.prompt_template_encode_start_idx = pipe.prompt_template_encode_start_idx
        self.vae_scale_factor, self.device = pipe.vae_scale_factor, torch.device("cpu")

    def forward(self, req):
        return "stock pipeline"

    def load_weights(self, weights):
        """vLLM-Omni's AutoWeightsLoader routes "transformer.*" to the transformer (diffusers names here)."""
        params, loaded = dict(self.transformer.named_parameters()), set()
        with torch.no_grad():
            for name, t in weights:
                params[name.removeprefix("transformer.")].copy_(t)
                loaded.add(name)
        return loaded
