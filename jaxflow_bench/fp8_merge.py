"""What merging the LoRA into FP8 rollout weights would serve, against serving it as layers (CPU, float32 math).

vLLM-Omni's FP8 linears hold float8_e4m3fn weights quantized once at load with one scale per tensor (amax / 448);
the LoRA is served as layers over them (`rollout.lora_apply` 'layers'). A merge would write base + adapter into
those FP8 weights at each sync, at the load-time scale, in one of two ways:

- from an FP8 copy of the base (no extra memory beyond the FP8 weights): round(D(Q(W)) + delta);
- from a bf16 copy of the base (bf16 memory beside the FP8 weights, or a host copy sent at each sync):
  round(W + delta).

For a seeded random weight W (out x in: Gaussian, or Student-t with 4 degrees of freedom for heavier tails), a
rank-r adapter term delta scaled to a relative RMS rho of W's, and random inputs x, each path's output against the
exact x (W + delta)^T, all in float32: `DIST/rho_R/layers_rel`, `merge_fp8_rel`, `merge_bf16_rel` (relative output
error), and `merge_fp8_adapter_err`, `merge_bf16_adapter_err` (the merged output minus the layers one, relative to
the adapter's own output x delta^T: 1 means the adapter was not served at all). FP8 is a float format: its relative
step is about the same for a Gaussian and a heavy-tailed weight. Random weights are not trained ones.

    python -m jaxflow_bench.fp8_merge --out OUT            # a 3072 x 3072 linear (the recipe model's width), r64
    python -m jaxflow_bench.fp8_merge --out OUT --size tiny
"""
from __future__ import annotations

import argparse

import torch

from jaxflow_bench.results import write_result

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
SIZES = {"full": dict(out_f=3072, in_f=3072, rank=64, tokens=256), "tiny": dict(out_f=256, in_f=192, rank=8, tokens=64)}
RHOS = (1e-4, 1e-3, 1e-2, 1e-1)
DISTS = ("gauss", "t4")


def quantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn of w / scale, clamped to its finite range (round to nearest even)."""
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


def weight(dist: str, out_f: int, in_f: int, generator: torch.Generator) -> torch.Tensor:
    """A random float32 weight of RMS about 0.02."""
    if dist == "gauss":
        return torch.randn(out_f, in_f, generator=generator) * 0.02
    # Student-t(4) as a normal over the root of a chi-square(4) / 4 (variance 2: scaled to RMS 0.02)
    z = torch.randn(out_f, in_f, generator=generator)
    chi2 = torch.randn(4, out_f, in_f, generator=generator).pow(2).sum(0)
    return z / (chi2 / 4).sqrt() * (0.02 / 2 ** 0.5)


def paths(w: torch.Tensor, delta: torch.Tensor, x: torch.Tensor) -> dict:
    """Each path's figures for one weight, adapter term and input batch."""
    scale = w.abs().max() / FP8_MAX
    base = dequantize(quantize(w, scale), scale)
    exact = x @ (w + delta).T
    adapter = x @ delta.T
    layers = x @ base.T + adapter
    merge_fp8 = x @ dequantize(quantize(base + delta, scale), scale).T
    merge_bf16 = x @ dequantize(quantize(w + delta, scale), scale).T

    def off(a, b, by):
        return float((a - b).norm() / by.norm())

    return dict(layers_rel=off(layers, exact, exact), merge_fp8_rel=off(merge_fp8, exact, exact),
                merge_bf16_rel=off(merge_bf16, exact, exact), merge_fp8_adapter_err=off(merge_fp8, layers, adapter),
                merge_bf16_adapter_err=off(merge_bf16, layers, adapter))


def measure(size: str = "full", seed: int = 0) -> dict:
    """{DIST/rho_R/FIGURE: value} over the weight distributions and adapter sizes."""
    s = SIZES[size]
    figures = {}
    for dist in DISTS:
        g = torch.Generator().manual_seed(seed)
        w = weight(dist, s["out_f"], s["in_f"], g)
        a = torch.randn(s["rank"], s["in_f"], generator=g) / s["in_f"] ** 0.5
        b = torch.randn(s["out_f"], s["rank"], generator=g)
        x = torch.randn(s["tokens"], s["in_f"], generator=g)
        direction = b @ a
        for rho in RHOS:
            delta = direction * (rho * w.pow(2).mean().sqrt() / direction.pow(2).mean().sqrt())
            for name, value in paths(w, delta, x).items():
                figures[f"{dist}/rho_{rho:.0e}/{name}"] = value
    return figures


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for fp8_merge.json")
    p.add_argument("--size", choices=sorted(SIZES), default="full")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    figures = measure(a.size, a.seed)
    path = write_result(a.out, "fp8_merge", figures, extra=dict(size=a.size, shape=SIZES[a.size], seed=a.seed))
    for key, value in figures.items():
        print(f"{key:40s} {value:.4g}")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
