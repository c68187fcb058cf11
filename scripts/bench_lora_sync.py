"""LoRA sync, trainer -> in-process engine: the host path (numpy PEFT arrays) vs the DLPack path (device tensors).

    python scripts/bench_lora_sync.py --out DIR            # Qwen-Image size (60 layers, r=64: 425M params), GPU
    python scripts/bench_lora_sync.py --tiny --out DIR     # code-path check on CPU
    python scripts/bench_lora_sync.py --layers 2 --out DIR # full width, 2 layers (on CPU without a GPU)

Both paths start from the trainer's float32 LoRA state on the JAX device and end with the engine's bf16 adapters
filled (`LoraApplier.apply`, the copy the diffusers engine makes; it waits for its copies). Host:
`lora_to_peft` (device transpose, host copy), then apply from host memory. DLPack: `lora_sync.device_peft_tensors`
(transpose + cast in one jit, torch views), then apply on the device. The engine side is the 720 target Linear
layers alone (random bf16 base weights, no attention or norms: apply touches nothing else). Median of --iters
after one warm-up each (compilation and PEFT injection excluded); both paths must leave the same adapter bytes.
Writes DIR/lora_sync.json (`jaxflow_bench/results.py`).
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch allocates beside JAX

import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402

from jaxflow.sync.lora_sync import device_peft_tensors, device_target  # noqa: E402
from jaxflow.families.qwen_image.config import QwenImageConfig  # noqa: E402
from jaxflow.nn.config import ModelOptions  # noqa: E402
from jaxflow.nn.lora import LoRAParam, lora_to_peft, peft_stacks  # noqa: E402
from jaxflow.families.qwen_image.lora import QwenImageLoRASpec
from jaxflow.families.qwen_image.transformer import QwenImageTransformer  # noqa: E402
from jaxflow_bench.cli import bench_parser  # noqa: E402
from jaxflow_bench.results import write_result  # noqa: E402
from jaxflow_bench.workload import FULL, TINY  # noqa: E402
from jaxflow_bridge.sync.layers import ADAPTER_NAME, LoraApplier  # noqa: E402


def random_lora(cfg: QwenImageConfig, spec: QwenImageLoRASpec) -> nnx.State:
    """The trainer's LoRA state (float32, stacked over layers) with random values, without building the model."""
    abstract = nnx.state(nnx.eval_shape(lambda: QwenImageTransformer(cfg, ModelOptions(), spec, rngs=nnx.Rngs(0))),
                         LoRAParam)
    leaves, tree = jax.tree.flatten(abstract)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    draw = jax.jit(lambda k, shape: 0.01 * jax.random.normal(k, shape, jnp.float32), static_argnums=1)
    return jax.tree.unflatten(tree, [draw(k, x.shape) for k, x in zip(keys, leaves)])


def engine_targets(lora: nnx.State, spec: QwenImageLoRASpec, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """The engine's target Linear layers under their diffusers names, shaped from the PEFT tensors."""
    features = {}  # module -> {"A": in, "B": out}
    for keys, stacked in peft_stacks(lora, spec):
        for key in keys:
            module, _, part = key.removesuffix(".weight").rpartition(".lora_")
            features.setdefault(module, {})[part] = stacked.shape[-1] if part == "A" else stacked.shape[-2]
    root = torch.nn.Module()
    for module, f in features.items():
        parent, (*path, leaf) = root, module.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.add_module(leaf, torch.nn.utils.skip_init(torch.nn.Linear, f["A"], f["B"], bias=False, device=device,
                                                         dtype=dtype))  # base weights unread: left uninitialised
    return root


def adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if f".{ADAPTER_NAME}." in n}


def timed(fn, iters: int) -> list[float]:
    """Seconds per call of fn() (which waits for its own work), after one warm-up call."""
    fn()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main(argv=None):
    p = bench_parser(__doc__, tiny=True)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--layers", type=int, help="fewer layers of the chosen width (e.g. full width on a CPU)")
    p.add_argument("--engine_dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args(argv)
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda:0"
    dims = TINY if args.tiny else FULL
    cfg = QwenImageConfig(**{**dims, "num_layers": args.layers or dims["num_layers"]})
    spec = QwenImageLoRASpec(rank=args.rank, alpha=2.0 * args.rank)
    target = device_target({"device": device, "dtype": args.engine_dtype})
    if target is None:
        raise SystemExit(f"error: JAX has no device for the engine's {device}; install a CUDA jaxlib or pass --tiny")
    lora = jax.device_put(random_lora(cfg, spec), target.device)
    jax.block_until_ready(lora)
    applier = LoraApplier(engine_targets(lora, spec, device, getattr(torch, args.engine_dtype)))
    config = spec.peft_config()
    parts = {"host_export": [], "host_apply": [], "dlpack_export": [], "dlpack_apply": []}

    def sync(path: str):
        t = time.perf_counter()
        tensors = lora_to_peft(lora, spec) if path == "host" else device_peft_tensors(lora, spec, target)
        parts[f"{path}_export"].append(time.perf_counter() - t)
        t = time.perf_counter()
        applier.apply(tensors, config)
        parts[f"{path}_apply"].append(time.perf_counter() - t)

    host_s = timed(lambda: sync("host"), args.iters)
    want = adapters(applier.model)
    dlpack_s = timed(lambda: sync("dlpack"), args.iters)
    got = adapters(applier.model)
    same = want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    ms = {k: 1e3 * statistics.median(v[1:]) for k, v in parts.items()}  # [0] is the warm-up
    params = sum(x.size for x in jax.tree.leaves(lora))
    figures = {"lora_params": params, "modules": applier.bound_modules(), "engine_dtype": args.engine_dtype,
               "host_ms": 1e3 * statistics.median(host_s), "dlpack_ms": 1e3 * statistics.median(dlpack_s),
               **{f"{k}_ms": v for k, v in ms.items()}, "same_bytes": same}
    figures["speedup"] = figures["host_ms"] / figures["dlpack_ms"]
    name = "lora_sync" + ("_tiny" if args.tiny else "") + (f"_{cfg.num_layers}layers" if args.layers else "")
    path = write_result(args.out, name, figures,
                        extra={"jax_device": str(target.device), "torch_device": device, "rank": args.rank,
                               "layers": cfg.num_layers})
    print(f"LoRA sync r={args.rank}, {params / 1e6:.1f}M params, {figures['modules']} modules, engine "
          f"{args.engine_dtype} on {device}: host {figures['host_ms']:.1f} ms (export {ms['host_export']:.1f} + "
          f"apply {ms['host_apply']:.1f}), DLPack {figures['dlpack_ms']:.1f} ms (export {ms['dlpack_export']:.1f} "
          f"+ apply {ms['dlpack_apply']:.1f}); same bytes: {same}; {path}")
    if not same:
        raise SystemExit("error: the DLPack path left other adapter bytes than the host path")


if __name__ == "__main__":
    main()
