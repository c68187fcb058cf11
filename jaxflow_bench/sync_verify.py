"""The LoRA sync check's trainer-side cost (`expected_of` + `mismatch`, the step metric `sync_verify_s`) at the
default family's recipe LoRA (its rank, alpha and targets, through the family registry) over full-size stacks:
random float32, 60 blocks of d=3072 and MLP 12288 by default (720 PEFT modules at r=64), on whatever device JAX has.

    python -m jaxflow_bench.sync_verify OUT [--config RECIPE] [--layers 60 --dim 3072 --mlp 12288 --repeats 10]
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxflow import families as jax_families
from jaxflow.config.validation import config_module
from jaxflow.nn.lora import LoRAParam
from jaxflow.sync.verify import expected_of, mismatch
from jaxflow_bench.results import write_result
from jaxflow_bridge.contract.served import ServedProbe
from jaxflow_bridge.engines import families


def lora_state(spec, layers: int, dim: int, mlp: int, seed: int = 0) -> nnx.State:
    """A LoRA state of `spec`'s targets at these sizes, as `nnx.state(model, LoRAParam)` lays it out."""
    rng = np.random.default_rng(seed)
    tree: dict = {}
    for e in spec.key_map():
        name = e.flax_path[-2]
        fan_in, fan_out = {"mlp_in": (dim, mlp), "mlp_out": (mlp, dim)}.get(name[4:], (dim, dim))
        shape = (layers, fan_in, spec.rank) if e.flax_path[-1] == "lora_a" else (layers, spec.rank, fan_out)
        node = tree
        for p in e.flax_path[:-1]:
            node = node.setdefault(p, {})
        node[e.flax_path[-1]] = LoRAParam(jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02))
    return nnx.State(tree)


def served_by(want) -> dict:
    """A healthy engine's ack for `want`: its expected deltas, each with a tolerance of 1e-6."""
    deltas = {m: v.tolist() for m, v in want.deltas.items()}
    return {"served": ServedProbe(want.version, want.modules, deltas,
                                  {m: [1e-6] * len(v) for m, v in deltas.items()}).to_dict()}


def measure(lora, spec, repeats: int) -> dict:
    """Median seconds of `expected_of` and of `mismatch` over `repeats` versions, after two warm-up versions."""
    expect, check = [], []
    for version in range(1, repeats + 3):
        began = time.perf_counter()
        want = expected_of(lora, spec, version)
        middle = time.perf_counter()
        assert mismatch([served_by(want)], want, "bench") is None
        done = time.perf_counter()
        if version > 2:
            expect.append(middle - began)
            check.append(done - middle)
    return {"expected_of_s": statistics.median(expect), "mismatch_s": statistics.median(check),
            "sync_verify_s": statistics.median(e + c for e, c in zip(expect, check)), "modules": want.modules,
            "probed_modules": len(want.deltas)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="folder for sync_verify_<platform>.json")
    p.add_argument("--layers", type=int, default=60)
    p.add_argument("--dim", type=int, default=3072)
    p.add_argument("--mlp", type=int, default=12288)
    p.add_argument("--config", default=families.spec(families.DEFAULT).E2E["config"],
                   help="the recipe whose LoRA is checked (default: the default family's)")
    p.add_argument("--rank", type=int, help="another rank (alpha = 2 x rank) than the recipe's")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    recipe = config_module(args.config).get_config()
    if args.rank:
        recipe.lora.rank, recipe.lora.alpha = args.rank, 2.0 * args.rank
    spec = jax_families.by_name(recipe.model.family).lora_spec(recipe)
    lora = lora_state(spec, args.layers, args.dim, args.mlp)
    figures = measure(lora, spec, args.repeats)
    figures["lora_params"] = sum(x.size for x in jax.tree.leaves(lora))
    platform = jax.devices()[0].platform
    print(figures)
    print(write_result(args.out, f"sync_verify_{platform}", figures,
                       extra={"shapes": {"rank": spec.rank, **{k: getattr(args, k) for k in ("layers", "dim", "mlp")}}}))


if __name__ == "__main__":
    main()
