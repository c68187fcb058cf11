"""jaxflow_bridge/rollout/kernels/lora_linear.py: the fused LoRA'd linear and the LoRA added after a quantized base
against the per-slice sum, under torch.compile, and their routing inside a stand-in of vLLM-Omni's diffusion LoRA layer
(vLLM-Omni itself needs a GPU)."""
from __future__ import annotations

import pytest
import torch

from jaxflow_bridge.rollout.kernels.lora_linear import (BATCHED_ROWS, adapter_slots, install_fused_apply, lora_add,
                                                        lora_linear, unquantized)


def per_slice(x, w, bias, a_list, b_list):
    """vLLM-Omni's semantics: the base linear, then each slice's (x @ A.T) @ B.T added to its rows."""
    y = torch.nn.functional.linear(x, w, bias)
    parts, row = [], 0
    for a, b in zip(a_list, b_list):
        parts.append(y[..., row:row + b.shape[0]] + (x @ a.t()) @ b.t())
        row += b.shape[0]
    return torch.cat(parts, -1)


def problem(slices=(12, 12, 12), rank=4, fan_in=16, bias=True, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 7, fan_in, generator=g, dtype=dtype)
    w = torch.randn(sum(slices), fan_in, generator=g, dtype=dtype)
    b = torch.randn(sum(slices), generator=g, dtype=dtype) if bias else None
    a_list = [torch.randn(rank, fan_in, generator=g, dtype=dtype) for _ in slices]
    b_list = [torch.randn(s, rank, generator=g, dtype=dtype) for s in slices]
    return x, w, b, a_list, b_list


@pytest.mark.parametrize("slices,bias", [((12, 12, 12), True), ((20,), True), ((20,), False), ((5, 9), True)])
def test_equals_the_per_slice_sum(slices, bias):
    args = problem(slices, bias=bias)
    got, want = lora_linear(*args), per_slice(*args)
    assert got.shape == want.shape == (2, 7, sum(slices))
    # float64 on both sides: only the summation order differs (inner sizes <= 16 + 12 terms)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)


def test_bfloat16_within_rounding_of_the_float64_sum():
    x, w, b, a_list, b_list = problem(rank=8, fan_in=64)
    want = per_slice(x, w, b, a_list, b_list)
    got = lora_linear(*(t.bfloat16() for t in (x, w, b)), [a.bfloat16() for a in a_list],
                      [t.bfloat16() for t in b_list]).double()
    # bf16's unit roundoff u = 2^-8 (relative 2^-9 per rounding): x, w, A, B, bias and h are each rounded once
    # (<= 3 roundings along any product: under 2u of |term|), the LoRA term plus bias once more and the output once
    # (u of |y|); products accumulate in float32. Bound each element by those terms' absolute sums.
    terms = per_slice(x.abs(), w.abs(), b.abs(), [a.abs() for a in a_list], [t.abs() for t in b_list])
    assert torch.all((got - want).abs() <= 2 * 2 ** -8 * terms + 2 ** -8 * want.abs())


def test_refuses_slices_that_do_not_tile_the_output():
    x, w, b, a_list, b_list = problem((12, 12, 12))
    with pytest.raises(ValueError, match="do not tile"):
        lora_linear(x, w, b, a_list, b_list[:2])
    base = torch.nn.functional.linear(x, w, b)
    before = base.clone()
    with pytest.raises(ValueError, match="do not tile"):
        lora_add(base, x, a_list, b_list[:2])
    assert torch.equal(base, before)  # refused before anything is added


def added(base, x, a_list, b_list):
    """`lora_add` of a base output, which it updates in place."""
    lora_add(base, x, a_list, b_list)
    return base


@pytest.mark.parametrize("slices,bias", [((12, 12, 12), True), ((20,), False), ((5, 9), True)])
def test_lora_add_after_a_base_output_equals_the_per_slice_sum(slices, bias):
    x, w, b, a_list, b_list = problem(slices, bias=bias)
    got = added(torch.nn.functional.linear(x, w, b), x, a_list, b_list)
    want = per_slice(x, w, b, a_list, b_list)
    assert got.shape == want.shape and torch.allclose(got, want, rtol=0, atol=1e-12)


def test_lora_add_updates_the_base_output_without_copying_it():
    """An out-of-place addmm copies its C into the result first (on a GPU, a device-to-device copy of each FP8
    linear's output: 0.037 s an image of the FP8 rollout's profile); in place, the only copies are B's blocks."""
    x, w, b, a_list, b_list = problem((12, 12, 12))
    base = torch.nn.functional.linear(x, w, b)
    pointer = base.data_ptr()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        lora_add(base, x, a_list, b_list)
    copied = [e.input_shapes[0] for e in prof.events() if e.key == "aten::copy_"]
    assert copied == [list(t.shape) for t in b_list]  # block_diag's
    assert base.data_ptr() == pointer and torch.allclose(base, per_slice(x, w, b, a_list, b_list), rtol=0, atol=1e-12)


def test_lora_add_in_bfloat16_within_rounding_of_the_float64_sum():
    """The base output (an FP8 GEMM's, here bf16's) rounded once; h rounded once; the LoRA terms added to it in the
    expansion GEMM's float32 accumulator and the sum rounded once."""
    x, w, b, a_list, b_list = problem(rank=8, fan_in=64)
    want = per_slice(x, w, b, a_list, b_list)
    xb = x.bfloat16()
    base = torch.nn.functional.linear(xb, w.bfloat16(), b.bfloat16())
    got = added(base, xb, [a.bfloat16() for a in a_list], [t.bfloat16() for t in b_list]).double()
    terms = per_slice(x.abs(), w.abs(), b.abs(), [a.abs() for a in a_list], [t.abs() for t in b_list])
    assert torch.all((got - want).abs() <= 3 * 2 ** -8 * terms + 2 ** -8 * want.abs())


@pytest.mark.parametrize("tokens", [BATCHED_ROWS, 5])
def test_a_slice_of_a_longer_sequence(tokens):
    """vLLM-Omni's to_out / to_add_out get the image / text slice of the joint attention output: a view whose
    leading dims do not fold. A long one runs as strided-batched GEMMs that read it in place, a short one is
    copied; both give the per-slice sum."""
    x, w, b, a_list, b_list = problem((12, 12, 12))
    joint = torch.randn(3, 9 + tokens, x.shape[-1], dtype=x.dtype)
    part = joint[:, 9:]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = lora_linear(part, w, b, a_list, b_list)
    ops = {e.key for e in prof.key_averages()}
    want = per_slice(part, w, b, a_list, b_list)
    assert got.shape == want.shape == (3, tokens, w.shape[0]) and got.is_contiguous()
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    assert "aten::mm" in ops  # the expansion
    if tokens >= BATCHED_ROWS:
        assert {"aten::bmm", "aten::baddbmm_"} <= ops and not {"aten::addmm_", "aten::clone"} & ops
    else:
        assert "aten::addmm_" in ops and "aten::clone" in ops and not {"aten::bmm", "aten::baddbmm_"} & ops


def test_torch_compile_calls_it_with_dynamic_shapes():
    x, w, b, a_list, b_list = problem((12, 12, 12), dtype=torch.float32)

    def layer(x):
        return torch.nn.functional.gelu(lora_linear(x, w, b, a_list, b_list))

    compiled = torch.compile(layer, backend="aot_eager", dynamic=True, fullgraph=True)
    for tokens in (7, 11):
        xs = torch.randn(2, tokens, 16)
        assert torch.allclose(compiled(xs), layer(xs), rtol=0, atol=0)

    def after_base(x):
        return torch.nn.functional.gelu(added(torch.nn.functional.linear(x, w, b), x, a_list, b_list))

    compiled = torch.compile(after_base, backend="aot_eager", dynamic=True, fullgraph=True)
    for tokens in (7, 11):
        xs = torch.randn(2, tokens, 16)
        assert torch.allclose(compiled(xs), after_base(xs), rtol=0, atol=0)


def test_inductor_adds_the_lora_into_the_base_gemms_buffer_without_a_copy():
    """Under Inductor (vLLM-Omni compiles the blocks) the in-place op runs on the base GEMM's own output buffer:
    no clone of it for the mutation, the result as eager's."""
    from torch._inductor.utils import run_and_get_code

    x, w, b, a_list, b_list = problem((12, 12, 12), dtype=torch.float32)

    def after_base(x):
        return torch.nn.functional.gelu(added(torch.nn.functional.linear(x, w, b), x, a_list, b_list))

    xs = torch.randn(2, 7, 16)
    got, code = run_and_get_code(torch.compile(after_base, dynamic=True, fullgraph=True), xs)
    source = "\n".join(code)
    calls = [line for line in source.splitlines() if "torch.ops.jaxflow.lora_add.default(" in line]
    assert len(calls) == 1 and "clone" not in source and "copy_" not in source, source[-3000:]
    assert torch.allclose(got, after_base(xs), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------ routing


class UnquantizedLinearMethod:  # the name vLLM gives its plain GEMM
    pass


class ViewingQuantizedMethod:
    """An FP8 quant method's input handling (vLLM's ScaledMMLinearKernel: `x.view(-1, x.shape[-1])`)."""

    def apply(self, layer, x, bias=None):
        return torch.nn.functional.linear(x.view(-1, x.shape[-1]), layer.weight, bias).view(*x.shape[:-1], -1)


class StandInLoRALayer(torch.nn.Module):
    """The attributes of vLLM-Omni 0.20's DiffusionBaseLinearLayerWithLoRA that `fused_slots` reads."""

    calls = 0

    def __init__(self, args, quant=UnquantizedLinearMethod):
        super().__init__()
        x, w, b, a_list, b_list = args
        self.base_layer = torch.nn.Linear(w.shape[1], w.shape[0], dtype=w.dtype)
        self.base_layer.weight.data.copy_(w)
        self.base_layer.quant_method = quant()
        self.lora_a_stacked = tuple(a[None, None] for a in a_list)
        self.lora_b_stacked = tuple(b_[None, None] for b_ in b_list)
        self._diffusion_lora_active_slices = (True,) * len(a_list)

    def apply(self, x, bias=None):
        type(self).calls += 1
        return per_slice(x, self.base_layer.weight, bias, [a[0, 0] for a in self.lora_a_stacked],
                         [b[0, 0] for b in self.lora_b_stacked])


def test_install_routes_eligible_layers_and_keeps_the_rest():
    cls = type("Layer", (StandInLoRALayer,), {"calls": 0})
    assert install_fused_apply(cls) and not install_fused_apply(cls)
    args = problem()
    layer = cls(args)
    assert adapter_slots(layer) is not None and unquantized(layer)
    got = layer.apply(args[0], args[2])
    assert cls.calls == 0 and torch.allclose(got, per_slice(*args), rtol=0, atol=1e-12)

    for quant in (UnquantizedLinearMethod, ViewingQuantizedMethod):
        other = cls(args, quant=quant)
        other._diffusion_lora_active_slices = (True, False, True)  # one slice without an adapter
        assert adapter_slots(other) is None
        before = cls.calls
        other.apply(args[0], args[2])
        assert cls.calls == before + 1


def test_a_quantized_base_layer_gets_its_gemm_and_then_lora_add():
    """An FP8 base: its quant method's GEMM (bias included), then every slice's LoRA term, not the stock apply."""
    cls = type("Layer", (StandInLoRALayer,), {"calls": 0})
    install_fused_apply(cls)
    args = problem()
    layer = cls(args, quant=ViewingQuantizedMethod)
    assert adapter_slots(layer) is not None and not unquantized(layer)
    got = layer.apply(args[0], args[2])
    assert cls.calls == 0 and torch.allclose(got, per_slice(*args), rtol=0, atol=1e-12)


def test_a_quantized_base_layer_gets_a_contiguous_input():
    """Qwen-Image's `to_out` gets a slice of the joint attention's output (not contiguous): vLLM's FP8 kernels
    refuse to view it as rows (FP8 rollout failed on an H200 at its first call)."""
    args = problem()
    cls = type("Layer", (StandInLoRALayer,), {"calls": 0})
    cls.apply = lambda self, x, bias=None: self.base_layer.quant_method.apply(self.base_layer, x, bias)
    layer = cls(args, quant=ViewingQuantizedMethod)
    joint = torch.randn(2, 7, args[0].shape[-1], dtype=args[0].dtype)
    image_part = joint[:, 3:]  # the image tokens of a joint sequence
    assert not image_part.is_contiguous()
    with pytest.raises(RuntimeError, match="view"):
        layer.apply(image_part)
    install_fused_apply(cls)
    got = layer.apply(image_part)
    want = per_slice(image_part, layer.base_layer.weight, None, args[3], args[4])
    assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-12, atol=1e-12)
