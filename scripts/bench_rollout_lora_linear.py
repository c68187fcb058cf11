"""The rollout's LoRA'd linears at Qwen-Image's image-stream shapes: vLLM-Omni's per-slice apply vs the fused op.

    python3 scripts/bench_rollout_lora_linear.py --out DIR          # a CUDA GPU; writes DIR/rollout_lora_linear.json
    python3 scripts/bench_rollout_lora_linear.py --tiny --out DIR   # code-path check on the CPU (small shapes)

One transformer block's four adapted image-stream linears (fused q/k/v 3072 -> 3 x 3072, to_out 3072 -> 3072, MLP
3072 -> 12288 and 12288 -> 3072) at T tokens (default 32768: 16 images x 2 for CFG x 1024 tokens, one forward of a
16-image request at 512^2), r=64, bf16, with bias, in ms per block (median of REPEATS after warm-ups, CUDA events):
- `base`: the linears without LoRA (the floor);
- `stock`: vLLM-Omni 0.20's semantics, y = linear(x); y[:, s] = y[:, s] + (x @ A_s.T) @ B_s.T per slice, eager and
  under torch.compile (vLLM-Omni compiles its blocks);
- `fused`: `jaxflow_bridge.rollout.kernels.lora_linear.lora_linear`, eager and compiled.
Per rollout of 32 images (2 requests x 10 steps x 60 blocks) the LoRA overhead over `base` is printed in seconds.
Each variant's output is checked against a float32 reference within bf16 rounding.

Then to_out alone on what vLLM-Omni hands it, the image slice of the joint attention output ((32, text + 1024, 3072)
at T = 32768, text 96 tokens): the fused op reading the slice in place (strided-batched GEMMs, `slice_batched`)
against the slice copied first, as a reshape does (`slice_copied`), eager.

Then the image MLP's in-projection and tanh GELU on T / 2 rows (one CFG half): GELU as its own kernel (eager,
compiled) against the GELU in the GEMM's cuBLASLt epilogue (`jaxflow_bridge.families.qwen_image.linear_gelu`).
"""
from __future__ import annotations

import statistics
import sys

import torch
import torch.nn.functional as F

from jaxflow_bench.cli import bench_parser
from jaxflow_bench.results import write_result
from jaxflow_bridge.families.qwen_image.linear_gelu import linear_gelu
from jaxflow_bridge.rollout.kernels.lora_linear import lora_linear

RANK, REPEATS = 64, 20
FULL = dict(tokens=32768, hidden=3072, mlp=12288)
TINY = dict(tokens=256, hidden=64, mlp=256)
FORWARDS_PER_ROLLOUT = 2 * 10 * 60  # requests x steps x blocks, 32 images at 512^2


def layers(hidden: int, mlp: int, device, dtype, seed: int = 0) -> list:
    """(weight, bias, [A_i], [B_i]) of the four adapted linears; B scaled, each LoRA term ~5% of the output."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    out = []
    for fan_in, slices in ((hidden, (hidden,) * 3), (hidden, (hidden,)), (hidden, (mlp,)), (mlp, (hidden,))):
        out.append((rand(sum(slices), fan_in, scale=fan_in ** -0.5), rand(sum(slices), scale=0.1),
                    [rand(RANK, fan_in, scale=fan_in ** -0.5) for _ in slices],
                    [rand(s, RANK, scale=0.05 * RANK ** -0.5) for s in slices]))
    return out


def base(x, w, b, a_list, b_list):
    return torch.nn.functional.linear(x, w, b)


def stock(x, w, b, a_list, b_list):
    y, row = torch.nn.functional.linear(x, w, b), 0
    for a, bb in zip(a_list, b_list):
        y[:, row:row + bb.shape[0]] = y[:, row:row + bb.shape[0]] + (x @ a.t()) @ bb.t()
        row += bb.shape[0]
    return y


def block(fn):
    """One block's four linears, each on its own input (the MLP's second on the first's width)."""
    def run(xs, params):
        return [fn(x, *p) for x, p in zip(xs, params)]
    return run


def median_ms(run, xs, params, device) -> float:
    for _ in range(3):
        run(xs, params)
    if device.type != "cuda":
        return float("nan")
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(xs, params)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def slice_figures(to_out, size, device, dtype, text: int = 96) -> dict:
    """ms of to_out (its fused op) on the image slice of a joint (text + image) attention output: read in place or
    copied first; both outputs equal up to the GEMMs' summation order."""
    rows = size["tokens"] // 32 if size["tokens"] >= 32 * 128 else 128
    g = torch.Generator(device="cpu").manual_seed(2)
    joint = torch.randn(size["tokens"] // rows, text + rows, size["hidden"], generator=g).to(device, dtype)
    part = joint[:, text:]
    with torch.no_grad():
        inplace = block(lora_linear)
        copied = block(lambda x, *p: lora_linear(x.reshape(-1, x.shape[-1]), *p))
        a, b = inplace([part], [to_out])[0], copied([part], [to_out])[0]
        err = float((a.float().reshape(b.shape) - b.float()).abs().max() / b.float().abs().max())
        assert err < 2 ** -6, f"slice: relative error {err} between the two paths"
        out = {"slice_batched_ms": median_ms(inplace, [part], [to_out], device),
               "slice_copied_ms": median_ms(copied, [part], [to_out], device), "slice_rows": rows}
    print(f"  to_out on the image slice: in place {out['slice_batched_ms']:.3f} ms, "
          f"copied {out['slice_copied_ms']:.3f} ms", flush=True)
    return out


def gelu_figures(size, device, dtype) -> dict:
    """ms of the image MLP's in-projection + tanh GELU on one CFG half of a 16-image request (T / 2 rows): the
    GEMM then GELU's elementwise kernel, eager and compiled (vLLM-Omni compiles its blocks), against the GELU in the
    GEMM's cuBLASLt epilogue (`linear_gelu`); each checked against a float32 reference."""
    g = torch.Generator(device="cpu").manual_seed(3)
    rows, hidden, mlp = size["tokens"] // 2, size["hidden"], size["mlp"]
    x = torch.randn(rows, hidden, generator=g).to(device, dtype)
    w = (torch.randn(mlp, hidden, generator=g) * hidden ** -0.5).to(device, dtype)
    b = (torch.randn(mlp, generator=g) * 0.1).to(device, dtype)

    def separate(xs, params):
        return [F.gelu(F.linear(xs[0], *params[0]), approximate="tanh")]

    def epilogue(xs, params):
        return [linear_gelu(xs[0], *params[0])]

    variants = {"separate_eager": separate, "separate_compiled": torch.compile(separate, dynamic=False),
                "epilogue": epilogue}
    out = {}
    with torch.no_grad():
        want = F.gelu(F.linear(x.float(), w.float(), b.float()), approximate="tanh")
        for name, run in variants.items():
            err = float((run([x], [(w, b)])[0].float() - want).abs().max() / want.abs().max())
            assert err < 2 ** -6, f"gelu {name}: relative error {err} beyond bf16 rounding"
            out[f"gelu_{name}_ms"] = median_ms(run, [x], [(w, b)], device)
            out[f"gelu_{name}_max_rel_err"] = err
    # image-stream MLP in-projections per rollout of 32 images: 2 requests x 10 steps x 2 CFG forwards x 60 blocks
    out["gelu_epilogue_saving_s_per_rollout"] = (out["gelu_separate_compiled_ms"] - out["gelu_epilogue_ms"]) * 2400 / 1e3
    print(f"  MLP in + GELU ({rows} rows): separate {out['gelu_separate_eager_ms']:.3f} ms eager, "
          f"{out['gelu_separate_compiled_ms']:.3f} compiled; epilogue {out['gelu_epilogue_ms']:.3f} ms "
          f"({out['gelu_epilogue_saving_s_per_rollout']:.2f} s a rollout of 32 images)", flush=True)
    return out


def main(argv=None) -> int:
    p = bench_parser(__doc__, tiny=True)
    p.add_argument("--tokens", type=int, default=None)
    args = p.parse_args(argv)
    size = dict(TINY if args.tiny else FULL)
    size["tokens"] = args.tokens or size["tokens"]
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    params = layers(size["hidden"], size["mlp"], device, dtype)
    g = torch.Generator(device="cpu").manual_seed(1)
    xs = [torch.randn(size["tokens"], w.shape[1], generator=g).to(device, dtype) for w, *_ in params]
    with torch.no_grad():
        want = [stock(x.float(), w.float(), b.float(), [a.float() for a in al], [t.float() for t in bl])
                for x, (w, b, al, bl) in zip(xs, params)]
        variants = {"base": block(base), "stock_eager": block(stock),
                    "stock_compiled": torch.compile(block(stock), dynamic=False),
                    "fused_eager": block(lora_linear), "fused_compiled": torch.compile(block(lora_linear), dynamic=False)}
        figures, worst = {}, 0.0
        for name, run in variants.items():
            ms = median_ms(run, xs, params, device)
            figures[f"{name}_ms"] = ms
            if name != "base":
                err = max(float(((g_.float() - w_).abs().max() / w_.abs().max())) for g_, w_ in zip(run(xs, params), want))
                worst = max(worst, err)
                assert err < 2 ** -6, f"{name}: relative error {err} beyond bf16 rounding"
            print(f"  {name:15s} {ms:8.3f} ms per block", flush=True)
    for name in ("stock_eager", "stock_compiled", "fused_eager", "fused_compiled"):
        figures[f"{name}_lora_s_per_rollout"] = (figures[f"{name}_ms"] - figures["base_ms"]) * FORWARDS_PER_ROLLOUT / 1e3
    figures.update(slice_figures(params[1], size, device, dtype))
    figures.update(gelu_figures(size, device, dtype))
    figures["max_rel_err"] = worst
    figures["tokens"] = size["tokens"]
    print("| variant | ms per block | LoRA s per rollout of 32 images |\n|---|---|---|")
    for name in variants:
        extra = figures.get(f"{name}_lora_s_per_rollout", 0.0)
        print(f"| {name} | {figures[name + '_ms']:.3f} | {extra:.2f} |")
    if not args.tiny:
        write_result(args.out, "rollout_lora_linear", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
