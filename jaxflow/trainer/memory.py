"""Does the train step fit the device's memory? Answered from XLA's compile-time memory analysis before the first
rollout (docs/design.md, "Memory").

The learner compiles its jitted functions ahead of time on the batch's shapes (`abstract_batch`), before it makes
the train state, and `check_fits` compares what they need on one device with what JAX's pool has free: arguments
not yet on the device (the train state, the batch; the frozen base weights are), temporaries, and outputs that do
not alias a donated argument. One line names the knobs when it does not fit; the run then stops with nothing
written. On a backend without memory statistics (the CPU) nothing is compared.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxflow.algorithms.nft import FIELDS as NFT_FIELDS
from jaxflow.trainer.train_batch import with_text_ids
from jaxflow_bridge.contract import batch as schema

GIB = 2 ** 30
KNOBS = ("train.num_micro_batches (more micro-batches: fewer samples in each forward and backward), a larger JAX pool "
         "(XLA_CLIENT_MEM_FRACTION, which leaves the rollout engine less), or model.remat=save_matmuls (saves less "
         "for the backward)")


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """One compiled function's bytes on one device (XLA's `memory_analysis`)."""

    name: str
    arguments: int
    outputs: int
    aliased: int
    temp: int

    @classmethod
    def of(cls, name: str, compiled) -> StepMemory:
        m = compiled.memory_analysis()
        return cls(name, int(m.argument_size_in_bytes), int(m.output_size_in_bytes), int(m.alias_size_in_bytes),
                   int(m.temp_size_in_bytes))

    def need(self, resident: int) -> int:
        """Bytes it must allocate when `resident` bytes of its arguments already lie on the device."""
        return max(0, self.arguments - resident) + self.temp + max(0, self.outputs - self.aliased)


def device_bytes(tree) -> int:
    """Bytes the arrays of `tree` hold on one device (their first addressable shard; host arrays count 0)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            total += leaf.addressable_shards[0].data.nbytes
    return total


def pool(device=None) -> tuple[int, int] | None:
    """(bytes_limit, bytes_in_use) of JAX's pool on `device` (default: the first local one), or None where the
    backend keeps no statistics (the CPU)."""
    stats = (device or jax.local_devices()[0]).memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))


def host_available() -> int:
    """Bytes of host memory available to a new allocation now (the OS's estimate, without swapping)."""
    import psutil
    return int(psutil.virtual_memory().available)


def host_shortfall(nbytes: int) -> str | None:
    """None where `nbytes` more fit in the host's available memory, else what is short: "X GiB, Y GiB available"."""
    available = host_available()
    return None if nbytes <= available else f"{nbytes / 2 ** 30:.1f} GiB, {available / 2 ** 30:.1f} GiB available"


# XLA's pool on a GPU is floor(fraction x CUDA's total), CUDA's total at most nvidia-smi's, which the plan's card
# holds floored to whole MiB: the planned pool exceeds fraction x the card's total by under one MiB. The margin is far
# above that (a driver or XLA that counts a little differently must not stop every run) and far below the failure it
# guards: JAX's default 75% against a planned share, tens of GiB on a 140 GiB card
POOL_MARGIN = 0.02  # of the card


class PoolLargerThanPlanned(RuntimeError):
    """JAX's pool is larger than the share of the GPU the plan gave it (`check_share`)."""


def check_share(fraction: float, card_bytes: int, devices, engine: str) -> None:
    """Stop (`PoolLargerThanPlanned`, one line naming the fix) where JAX's pool on one of `devices` is larger than
    `fraction` of a card of `card_bytes` by more than `POOL_MARGIN` of it: JAX started before the share was set, and
    `engine` (the engine sharing the GPU) will find no room. Devices without pool statistics (the CPU) pass."""
    planned = fraction * card_bytes
    for index, device in enumerate(devices):
        stats = pool(device)
        if stats is None or stats[0] <= planned + POOL_MARGIN * card_bytes:
            continue
        raise PoolLargerThanPlanned(
            f"JAX holds {stats[0] / GIB:.1f} GiB of GPU {index} where the plan gave it {planned / GIB:.1f} GiB "
            f"({fraction:g}): JAX started before its share was set (a JAX call before "
            f"jaxflow.config.machine.before_jax: a bug to report); {engine} has no room. Set "
            f"XLA_CLIENT_MEM_FRACTION={fraction:g} XLA_PYTHON_CLIENT_PREALLOCATE=true in the command's environment")


def check_fits(plans: list[StepMemory], resident: int, limit: int, in_use: int, what: str) -> str:
    """A one-line summary of the largest need against the pool; UserError-style ValueError naming `KNOBS` if it
    exceeds what is free. `resident`: bytes of the functions' arguments already on the device (the frozen base);
    `what`: the settings, for the message (e.g. "8 samples per micro-batch")."""
    worst = max(plans, key=lambda p: p.need(resident))
    need, free = worst.need(resident), limit - in_use
    summary = (f"train step memory per device ({what}): {worst.name} needs {need / GIB:.1f} GiB "
               f"({worst.temp / GIB:.1f} GiB temporaries) beside {in_use / GIB:.1f} GiB in use; "
               f"JAX's pool {limit / GIB:.1f} GiB")
    if need > free:
        raise MemoryError(f"{summary}: it does not fit ({(need - free) / GIB:.1f} GiB short). Set {KNOBS}")
    # a pool that fragments can still fail with little to spare (one H100 run did: BENCHMARKS.md)
    return f"{summary}, {(free - need) / GIB:.1f} GiB to spare"


def abstract_batch(*, batch: int, window: int, num_steps: int, seq: int, channels: int, text: int, width: int,
                   embed_dtype, guided: bool, recompute: bool, means: bool = False, nft: bool = False,
                   negative_text: int | None = None, text_ids: bool = False,
                   references: int = 0) -> tuple[dict, dict | None]:
    """Shapes and dtypes of the batch `train_step.prepare_batch` hands the step, every field per sample, from the batch
    schema (`schema.shapes`; text padded to `text` tokens, negatives to `negative_text`, default `text`:
    `config.text_tokens`), and of the old-log-prob pass's output when it runs (with `means`: the SDE means
    train.ratio_norm="guard" keeps); with `nft`, DiffusionNFT's batch (algorithms.nft.FIELDS); with `text_ids`, token
    ids (B, tokens) int32 in place of the embeds (a family whose text is token ids, `Family.batch_shape`; `width` and
    `embed_dtype` unused); with `references`, an edit model's reference latents (B, references, seq, channels)."""
    kind = "ids" if text_ids else "embeds"
    negatives = (f"negative_prompt_{kind}", "negative_prompt_mask") if guided else ()
    if nft:  # a loss on the final latents (DiffusionNFT's fields; AWM's too, with the negative text under CFG)
        names = (*(with_text_ids(NFT_FIELDS) if text_ids else NFT_FIELDS), *negatives)
    else:
        names = ("latents", "log_probs", "sigmas", "step_index", "noise_level", "advantages", f"prompt_{kind}",
                 "prompt_mask", *negatives)
    names += ("reference_latents",) if references else ()
    sizes = {"B": batch, "W": window, "N": num_steps, "S": seq, "C": channels, "L": text,
             "L'": negative_text or text, "D": width, "R": references}
    embeds = {"prompt_embeds": embed_dtype, "negative_prompt_embeds": embed_dtype}
    s = jax.ShapeDtypeStruct
    out = {k: s(*v) for k, v in schema.shapes(names, sizes, embeds, per_sample=True).items()}
    if nft:
        return out, None
    old = {"log_probs": out["log_probs"]}
    if means:
        old["means"] = s((batch, window, seq, channels), np.float32)
    return out, (old if recompute else None)
