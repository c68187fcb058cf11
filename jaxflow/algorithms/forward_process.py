"""What the forward-process algorithms (DiffusionNFT `nft`, AWM `awm`) share: the rollout's final latents noised
afresh at T timesteps a micro-batch, no SDE log-probs. `ForwardProcessLoss` is their component's common part,
`timestep_gradients` their gradient loop inside the train step (the counterpart of
`flowgrpo_step.accumulate_gradients`)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxflow.algorithms.base import Component
from jaxflow.trainer import minibatches


@dataclasses.dataclass(frozen=True)
class ForwardProcessLoss(Component):
    """A loss on the rollout's final latents (`fields`), noised at timesteps drawn from the seed, `salt` and the
    update count."""

    log_probs: bool = False
    salt: int = 0  # folded into the seed's key for the timesteps and noise (apart from the epochs' shuffles)

    def missing_hint(self, missing: list[str]) -> str:
        return (f" (the rollout keeps them with keep_final: config.sampling does for train.algorithm={self.name!r})"
                if "final_latents" in missing else "")

    def prepare(self, out: dict, batch, config) -> dict:
        return out

    def update_key(self, config, updates):
        """The key of an update's timesteps and noise: a function of the seed and the update count (a resume draws
        the same)."""
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(config.shuffle_seed), self.salt), updates)


def timestep_gradients(loss, lora, batch: dict, key, *, num_micro_batches: int, count: int, pick, fields,
                       layout=None):
    """The sum over micro-batches and noised timesteps of grad(loss / (M * T)) wrt `lora` (M = num_micro_batches,
    T = count) and the per-sample terms stacked as (M, T, B/M).

    `loss(lora, step, scale)` -> (scaled loss, terms), `step` holding the micro-batch's `fields` (those it has), "t"
    (b,) and "noise" (b, S, C); `pick(key, sigmas, count)` -> (b, T) timesteps of each sample's schedule. Each
    micro-batch's timesteps and noise come from its own split of `key`; `layout` (a Layout or None) shards its rows."""
    m = num_micro_batches
    grad_fn = jax.grad(loss, has_aux=True)

    def micro(grads, xs):
        mb, k = xs
        if layout is not None:
            mb = jax.lax.with_sharding_constraint(mb, layout.batch_sharding)
        draw_t, draw_noise = jax.random.split(k)
        t = pick(draw_t, mb["sigmas"], count).T  # (T, b)
        noise = jax.random.normal(draw_noise, (count, *mb["final_latents"].shape), jnp.float32)
        shared = {f: mb[f] for f in fields if f in mb}

        def timestep(grads, xs):
            g, terms = grad_fn(lora, {**shared, "t": xs[0], "noise": xs[1]}, 1.0 / (m * count))
            return jax.tree.map(jnp.add, grads, g), terms

        return jax.lax.scan(timestep, grads, (t, noise))

    xs = (minibatches.micro_batches(batch, m), jax.random.split(key, m))
    return jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, lora), xs)
