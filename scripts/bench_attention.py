"""cuDNN attention alone at the train step's shape: forward and forward+backward, with the text padding mask the model
passes (`key_value_seq_lengths`) and without it, beside XLA's attention.

    python3 scripts/bench_attention.py --out DIR            # on a GPU; writes DIR/attention_cudnn.json
    python3 scripts/bench_attention.py --tiny --out DIR     # code-path check on CPU (XLA only, small shapes)

Shape (B, S, H, D) = (8, 1152, 24, 128) bf16: 4 samples x true CFG, 1024 image + 128 text tokens, Qwen-Image's heads.
Each timed call runs LOOP attentions (or their gradients wrt q, k, v) in one jitted lax.scan, so the host dispatches
once; the figure is the best of REPEATS calls after a warm-up, per attention. FLOPs: forward 4 B H S^2 D, backward
2.5x that (the forward+backward column counts 3.5x).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxflow_bench.cli import bench_parser
from jaxflow_bench.results import write_result
from jaxflow_bench.timing import REPEATS, best_seconds

SHAPE, TINY_SHAPE = (8, 1152, 24, 128), (2, 40, 2, 16)
LOOP = 10


def per_call_ms(run, *args) -> float:
    """Milliseconds per attention: the best of REPEATS timed calls of `run` (LOOP attentions each)."""
    return best_seconds(run, *args) / LOOP * 1e3


def looped(fn, grad: bool):
    """LOOP calls of fn (or of its gradient) in one jit; each call's input depends on the last (nothing hoisted)."""
    if grad:
        fn = jax.grad(lambda q, k, v, f=fn: jnp.sum(f(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))

    @jax.jit
    def run(q, k, v):
        def body(c, _):
            return c + sum(o[0, 0, 0, 0] for o in jax.tree.leaves(fn(q + c, k, v))) * 0, None
        return jax.lax.scan(body, jnp.zeros((), q.dtype), None, length=LOOP)[0]
    return run


def main(argv=None) -> None:
    p = bench_parser(__doc__, tiny=True)
    args = p.parse_args(argv)
    b, s, h, d = TINY_SHAPE if args.tiny else SHAPE
    q, k, v = (jax.random.normal(key, (b, s, h, d), jnp.bfloat16) for key in jax.random.split(jax.random.key(0), 3))
    # valid keys: the image tokens plus each prompt's text (the negative prompts' 8 tokens in the second half)
    image, text = (s - 128, [74, 60, 90, 128, 8, 8, 8, 8]) if not args.tiny else (s // 2, [s // 4, s // 2])
    lens = jnp.asarray([image + t for t in text[:b]], jnp.int32)
    cases = {"xla_no_mask": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla")}
    if jax.default_backend() == "gpu":
        cases = {"cudnn_kv_len": lambda q, k, v: jax.nn.dot_product_attention(
                     q, k, v, key_value_seq_lengths=lens, implementation="cudnn"),
                 "cudnn_no_mask": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"),
                 **cases}
    flops = 4 * b * h * s * s * d
    figures = {}
    print(f"{'case':16s} {'fwd ms':>8s} {'TFLOP/s':>8s} {'fwd+bwd ms':>10s} {'TFLOP/s':>8s}")
    for name, fn in cases.items():
        fwd, both = per_call_ms(looped(fn, False), q, k, v), per_call_ms(looped(fn, True), q, k, v)
        figures.update({f"{name}_fwd_ms": fwd, f"{name}_fwd_bwd_ms": both, f"{name}_fwd_tflops": flops / fwd / 1e9,
                        f"{name}_fwd_bwd_tflops": 3.5 * flops / both / 1e9})
        print(f"{name:16s} {fwd:8.3f} {flops / fwd / 1e9:8.0f} {both:10.3f} {3.5 * flops / both / 1e9:8.0f}")
    print("wrote", write_result(args.out, "attention_cudnn", figures,
                                extra={"shape_bshd": [b, s, h, d], "loop": LOOP, "repeats": REPEATS}))


if __name__ == "__main__":
    main()
