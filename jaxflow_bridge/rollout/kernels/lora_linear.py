"""The rollout's LoRA'd linear layer as one op: base GEMM, LoRA shrink and expand and bias in three kernels.

vLLM-Omni 0.20's diffusion LoRA layers (`DiffusionBaseLinearLayerWithLoRA.apply`,
vllm_omni/diffusion/lora/layers/base_linear.py) add each output slice's LoRA term out of place,
`y[:, s] = y[:, s] + (x @ A_s.T) @ B_s.T`: a fused q/k/v layer reads its input three times and its output passes
through memory five more times per slice. At the real recipe's r=64 on 12 targets that costs the rollout ~4 s of 27 s a
step of 32 images at 512^2 (BENCHMARKS.md). `lora_linear` computes the same sum as

    h = x @ [A_1; ...; A_n].T                      one shrink GEMM over all slices (the input read once)
    y = [h | 1 | 0] @ [blockdiag(B_i) | bias | 0].T  every slice's expansion and the bias in one small GEMM
    y += x @ W.T                                   the base GEMM accumulating into y (cuBLAS beta = 1)

so the output is written once by the small GEMM and read back inside the base GEMM's epilogue. An input (B, S, in)
whose leading dims do not fold without a copy, with S >= BATCHED_ROWS (vLLM-Omni's to_out takes the image slice of
the joint attention output, a view into a longer sequence), goes through the shrink and the base GEMM as B
matrices of a strided-batched GEMM, read in place, where a reshape would copy it (the batched GEMM is slower than
the flat one by most of the copy's cost; the time saved: BENCHMARKS.md and benchmarks/HISTORY.md, the rollout's
LoRA'd linears). Numerics: the LoRA terms plus bias are rounded to the compute dtype once, then added to the base
product in the GEMM's float32 accumulator (vLLM-Omni rounds the base product, the LoRA term and their sum separately).

A quantized base (vLLM's FP8 linears) takes no accumulator: `lora_add` adds the same LoRA terms to its output in
place in two GEMMs, one shrink over all slices and one expansion that accumulates into the base output (cuBLAS's C,
beta = 1), where vLLM-Omni runs two GEMMs a slice and passes the output through memory three more times a slice. In
place, because an out-of-place addmm first copies its C into the result (a device-to-device copy of every FP8
linear's output); under torch.compile the op mutates the base GEMM's fresh output buffer and Inductor adds no copy.

Both are torch custom ops: torch.compile (vLLM-Omni compiles the transformer's blocks) calls them as they are instead
of decomposing the accumulation. `install_fused_apply` routes vLLM-Omni's layers to them where they compute the same
thing (`adapter_slots`: every slice's adapter present, no fully sharded LoRA): `lora_linear` on an unquantized base
weight, `lora_add` after a quantized one; any other layer keeps vLLM-Omni's own `apply`.
"""
from __future__ import annotations

import torch

ALIGN = 8  # the small GEMM's inner size is padded to a multiple of this (cuBLAS picks its fast kernels)
# rows per matrix from which a strided-batched GEMM reads a non-folding input in place: one GEMM tile; shorter
# slices (the text's, <= 96 tokens in the recipe) are copied, which is cheap, rather than re-read the weight B times
BATCHED_ROWS = 128


@torch.library.custom_op("jaxflow::lora_linear", mutates_args=())
def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: list[torch.Tensor],
                lora_b: list[torch.Tensor]) -> torch.Tensor:
    """x @ weight.T + bias + sum over slices of (x @ A_i.T) @ B_i.T placed at slice i's rows of the output.

    x (..., in); weight (out, in); bias (out,) or None; lora_a[i] (r_i, in); lora_b[i] (out_i, r_i), already scaled
    (alpha / r), sum of out_i == out.
    """
    _check_tiles(lora_a, lora_b, weight.shape[0], f" of weight {tuple(weight.shape)}")
    rank = sum(a.shape[0] for a in lora_a)
    inner = -(-(rank + 1) // ALIGN) * ALIGN
    a_t = torch.cat(lora_a).t()
    batched = x.dim() == 3 and x.shape[1] >= BATCHED_ROWS and x.stride(-1) == 1 and not _folds(x)
    if batched:  # (B, S, in) slices of a longer sequence: strided-batched GEMMs read them in place
        h = x.new_empty(*x.shape[:-1], inner)
        torch.bmm(x, a_t.expand(x.shape[0], -1, -1), out=h[..., :rank])
    else:
        x2 = x.reshape(-1, x.shape[-1])
        h = x2.new_empty(x2.shape[0], inner)
        torch.mm(x2, a_t, out=h[:, :rank])
    h[..., rank:].zero_()
    expand = weight.new_zeros(weight.shape[0], inner)
    row = col = 0
    for a, b in zip(lora_a, lora_b):
        expand[row:row + b.shape[0], col:col + a.shape[0]] = b
        row, col = row + b.shape[0], col + a.shape[0]
    if bias is not None:
        h[..., rank] = 1
        expand[:, rank] = bias
    y = torch.mm(h.view(-1, inner), expand.t())
    if batched:
        y = y.view(*x.shape[:-1], -1).baddbmm_(x, weight.t().expand(x.shape[0], -1, -1))
    else:
        y.addmm_(x2, weight.t())
    return y.view(*x.shape[:-1], weight.shape[0])


def _check_tiles(lora_a: list[torch.Tensor], lora_b: list[torch.Tensor], out: int, where: str = "") -> None:
    """ValueError unless the slices pair up (an A per B) and their outputs tile the `out` rows."""
    if sum(b.shape[0] for b in lora_b) != out or len(lora_a) != len(lora_b):
        raise ValueError(f"LoRA slices {[tuple(b.shape) for b in lora_b]} do not tile the output {out}{where}")


def _folds(x: torch.Tensor) -> bool:
    """Whether x's leading dims fold into one without a copy (as torch.matmul decides whether to fold)."""
    return all(x.stride(i) == x.stride(i + 1) * x.shape[i + 1] for i in range(x.dim() - 2) if x.shape[i] > 1)


@lora_linear.register_fake
def _lora_linear_shape(x, weight, bias, lora_a, lora_b):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("jaxflow::lora_add", mutates_args=("y",))
def lora_add(y: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor]) -> None:
    """y += sum over slices of (x @ A_i.T) @ B_i.T placed at slice i's rows of y, in place (y: a quantized base
    linear's output for x, (..., out) contiguous; lora_a, lora_b as `lora_linear`'s)."""
    _check_tiles(lora_a, lora_b, y.shape[-1])
    h = torch.mm(x.reshape(-1, x.shape[-1]), torch.cat(lora_a).t())
    y.view(-1, y.shape[-1]).addmm_(h, torch.block_diag(*lora_b).t())


@lora_add.register_fake
def _lora_add_shape(y, x, lora_a, lora_b) -> None:
    return None


def adapter_slots(layer) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """(A slots, B slots) of a vLLM-Omni LoRA layer with every slice's adapter present and no fully sharded LoRA,
    else None.

    The layer's active adapter sits in slot 0 of `lora_a_stacked[i]` (1, 1, r, in) and `lora_b_stacked[i]`
    (1, 1, out_i, r), B scaled; `_diffusion_lora_active_slices` says which slices hold one.
    """
    base = getattr(layer, "base_layer", None)
    a_stacked, b_stacked = getattr(layer, "lora_a_stacked", None), getattr(layer, "lora_b_stacked", None)
    active = getattr(layer, "_diffusion_lora_active_slices", ())
    config = getattr(layer, "lora_config", None)
    if (base is None
            or not a_stacked or not b_stacked or len(a_stacked) != len(b_stacked) or len(active) != len(a_stacked)
            or not all(active) or (config is not None and config.fully_sharded_loras)):
        return None
    return [a[0, 0] for a in a_stacked], [b[0, 0] for b in b_stacked]


def unquantized(layer) -> bool:
    """Whether a vLLM-Omni LoRA layer's base linear computes in its weights' dtype (no FP8 or other quant method)."""
    return type(getattr(layer.base_layer, "quant_method", None)).__name__ == "UnquantizedLinearMethod"


def install_fused_apply(layer_cls: type) -> bool:
    """Route `layer_cls.apply(x, bias)` (vLLM-Omni's diffusion LoRA layer base class), where `adapter_slots` finds
    the layer's adapters, to `lora_linear` (an unquantized base) or to the base layer's quantized GEMM and `lora_add`,
    else to the class's own apply. A quantized base layer's input is made contiguous (vLLM's FP8 kernels `view` it
    as rows, which a slice of a joint attention's output, as an MMDiT block's `to_out` gets, is not). False if it was
    installed already."""
    stock = layer_cls.apply
    if getattr(stock, "fused_lora", False):
        return False

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        slots = adapter_slots(self)
        if unquantized(self):
            return stock(self, x, bias) if slots is None else lora_linear(x, self.base_layer.weight, bias, *slots)
        x = x.contiguous()
        if slots is None:
            return stock(self, x, bias)
        y = self.base_layer.quant_method.apply(self.base_layer, x, bias)
        lora_add(y, x, *slots)
        return y

    apply.fused_lora, apply.stock = True, stock
    apply.__doc__ = f"{stock.__qualname__} through jaxflow_bridge.rollout.kernels.lora_linear where it applies."
    layer_cls.apply = apply
    return True
