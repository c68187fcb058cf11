"""The MLP in-projection with its tanh GELU as one op (jaxflow_bridge/families/qwen_image/linear_gelu.py): the formula,
the routing of vLLM-Omni's ColumnParallelApproxGELU (plain projections only), and torch.compile calling the op as is.
The cuBLASLt epilogue itself runs only on a GPU (scripts/bench_rollout_lora_linear.py checks it there)."""
import pytest
import torch
import torch.nn.functional as F

from jaxflow_bridge.families.qwen_image.linear_gelu import epilogue_applies, install_gelu_epilogue, linear_gelu


class UnquantizedLinearMethod:
    """vLLM's unquantized method, by name (the routing checks the class name)."""


class Proj(torch.nn.Module):
    """vLLM's ColumnParallelLinear as the routing sees it."""

    def __init__(self, fan_in=16, fan_out=48, bias=True, tp_size=1, skip_bias_add=False):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(fan_out, fan_in, generator=g) / fan_in ** 0.5)
        self.bias = torch.nn.Parameter(torch.randn(fan_out, generator=g)) if bias else None
        self.tp_size, self.skip_bias_add, self.quant_method = tp_size, skip_bias_add, UnquantizedLinearMethod()

    def forward(self, x):
        return F.linear(x, self.weight, None if self.skip_bias_add else self.bias)


def gelu_class():
    """A fresh ColumnParallelApproxGELU stand-in: proj, then gelu(approximate)."""
    calls = []

    def forward(self, x):
        calls.append(1)
        return F.gelu(self.proj(x), approximate=self.approximate)

    cls = type("ColumnParallelApproxGELU", (torch.nn.Module,), {"forward": forward})
    return cls, calls


def make(cls, proj, approximate="tanh"):
    m = cls()
    m.proj, m.approximate = proj, approximate
    return m


def test_the_op_is_the_tanh_gelu_of_the_linear():
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    p = Proj().double()
    want = 0.5 * (y := F.linear(x, p.weight, p.bias)) * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (y + 0.044715 * y ** 3)))
    got = linear_gelu(x, p.weight, p.bias)
    assert got.shape == (2, 5, 48)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert (got - F.gelu(y)).abs().max() > 1e-6  # not the exact (erf) GELU


@pytest.mark.parametrize("proj, approximate, routed", [
    (Proj(), "tanh", True),
    (Proj(bias=False), "tanh", False),
    (Proj(tp_size=2), "tanh", False),
    (Proj(skip_bias_add=True), "tanh", False),
    (Proj(), "none", False),
])
def test_only_plain_projections_take_the_op(proj, approximate, routed):
    cls, calls = gelu_class()
    assert install_gelu_epilogue(cls) and not install_gelu_epilogue(cls)  # once
    m = make(cls, proj, approximate)
    x = torch.randn(3, 16)
    out = m(x)
    assert (not calls) is routed
    torch.testing.assert_close(out, F.gelu(proj(x), approximate=approximate), rtol=0, atol=1e-6)


def test_a_lora_wrapped_projection_keeps_the_stock_forward():
    cls, calls = gelu_class()
    install_gelu_epilogue(cls)
    proj = Proj()
    wrapped = torch.nn.Module()
    wrapped.base_layer, wrapped.weight, wrapped.bias = proj, proj.weight, proj.bias
    wrapped.forward = proj.forward
    assert epilogue_applies(proj) and not epilogue_applies(wrapped)
    make(cls, wrapped)(torch.randn(2, 16))
    assert calls


def test_torch_compile_calls_the_op():
    cls, _ = gelu_class()
    install_gelu_epilogue(cls)
    m = make(cls, Proj())
    x = torch.randn(4, 16)
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    out = torch.compile(m, backend=backend, fullgraph=True)(x)
    assert any("linear_gelu" in t for t in seen), seen
    torch.testing.assert_close(out, F.gelu(m.proj(x), approximate="tanh"), rtol=0, atol=1e-6)
