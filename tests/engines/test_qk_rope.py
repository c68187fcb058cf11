"""jaxflow_bridge/families/qwen_image/qk_rope.py: the rollout attention's q/k norm and RoPE in torch ops, against
diffusers'
Qwen-Image functions (the reference vLLM-Omni's kernels implement), and the module swap."""
import pytest
import torch
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm
from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope, apply_rotary_emb_qwen

from jaxflow_bridge.families.qwen_image.qk_rope import (NativeRMSNorm, NativeRotary, rms_norm, rope_interleaved,
                                                  use_native_qk)


def freqs(seq: int, head_dim: int = 128) -> torch.Tensor:
    """Qwen-Image's complex RoPE frequencies for a 1 x 4 x (seq / 4) image grid: (seq, head_dim / 2)."""
    rope = QwenEmbedRope(theta=10000, axes_dim=[16, 56, 56], scale_rope=True)
    vid, _ = rope([(1, 4, seq // 4)], device=torch.device("cpu"), max_txt_seq_len=8)
    assert vid.shape == (seq, head_dim // 2)
    return vid


def test_rope_matches_diffusers_complex_rotation_in_float32():
    x = torch.randn(2, 32, 3, 128, generator=torch.Generator().manual_seed(0))
    f = freqs(32)
    ours = rope_interleaved(x, f.real, f.imag)
    want = apply_rotary_emb_qwen(x, f, use_real=False)
    # the same products and one sum per output in float32: within a few units of its rounding
    torch.testing.assert_close(ours, want, rtol=0, atol=4 * torch.finfo(torch.float32).eps * x.abs().max().item())
    # (1, S, D/2) cos/sin, as vLLM-Omni's RotaryEmbedding also takes them
    torch.testing.assert_close(rope_interleaved(x, f.real[None], f.imag[None]), ours, rtol=0, atol=0)


def test_rope_in_bf16_rounds_the_float32_rotation_once():
    x = torch.randn(2, 16, 2, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    f = freqs(16)
    cos, sin = f.real.bfloat16(), f.imag.bfloat16()  # vLLM-Omni casts them to the model dtype
    ours = rope_interleaved(x, cos, sin)
    assert ours.dtype == torch.bfloat16
    exact = apply_rotary_emb_qwen(x.float(), torch.complex(cos.float(), sin.float()), use_real=False)
    torch.testing.assert_close(ours, exact.bfloat16(), rtol=0, atol=0)


def test_rms_norm_matches_diffusers_bitwise_in_bf16():
    g = torch.Generator().manual_seed(2)
    x = (3 * torch.randn(4, 10, 6, 128, generator=g)).bfloat16()
    ref = DiffusersRMSNorm(128, eps=1e-6).bfloat16()
    with torch.no_grad():
        ref.weight.copy_(torch.rand(128, generator=g) + 0.5)
    torch.testing.assert_close(rms_norm(x, ref.weight, 1e-6), ref(x), rtol=0, atol=0)
    unweighted = rms_norm(x, None, 1e-6).float()
    torch.testing.assert_close(unweighted.pow(2).mean(-1), torch.ones(4, 10, 6), rtol=0, atol=2e-2)


class VllmNorm(torch.nn.Module):
    """The attributes of vLLM's RMSNorm that the swap reads."""

    def __init__(self, dim: int, has_weight: bool = True):
        super().__init__()
        self.has_weight, self.variance_epsilon = has_weight, 1e-6
        self.weight = torch.nn.Parameter(torch.rand(dim) + 0.5) if has_weight else torch.ones(dim)


class Rotary(torch.nn.Module):
    def __init__(self, neox: bool):
        super().__init__()
        self.is_neox_style = neox


class Attention(torch.nn.Module):
    def __init__(self, neox: bool = False):
        super().__init__()
        self.norm_q, self.norm_k = VllmNorm(8), VllmNorm(8)
        self.norm_added_q, self.norm_added_k = VllmNorm(8), VllmNorm(8, has_weight=False)
        self.rope = Rotary(neox)


def test_swap_keeps_each_weight_parameter_and_its_name():
    model = torch.nn.Sequential(Attention(), torch.nn.Linear(8, 8), Attention())
    before = dict(model.named_parameters())
    assert use_native_qk(model) == 2
    assert isinstance(model[0].norm_q, NativeRMSNorm) and isinstance(model[2].rope, NativeRotary)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert model[0].norm_added_k.weight is None  # vLLM's weightless norm stays weightless
    x = torch.randn(2, 5, 3, 8)
    torch.testing.assert_close(model[0].norm_q(x), rms_norm(x, before["0.norm_q.weight"], 1e-6))


def test_swap_refuses_another_rotary_layout_and_changes_nothing():
    model = torch.nn.Sequential(Attention(), Attention(neox=True))
    with pytest.raises(ValueError, match="qk_ops='vllm'"):
        use_native_qk(model)
    assert isinstance(model[0].norm_q, VllmNorm) and isinstance(model[0].rope, Rotary)
