"""Flow-matching pretraining of the Flax Qwen-Image transformer on the mini OCR data.

Rectified flow with the conventions the pipeline samples with (docs/numerics.md §1): x_t = (1 - s) x0 + s eps,
target v = eps - x0, the transformer fed sigma = s. s is logit-normal (sigmoid of N(0, 1), as SD3 trains) then
time-shifted with the scheduler's exponential shift at the mu of this image's token count, so training density
follows where the sampler's steps lie (shift_terminal, which only stretches the last steps, is left out).
With probability `p_uncond` a sample is conditioned on the negative prompt " " instead of its own: the model then
serves true CFG as the rollout runs it.

One functional jitted step: `nnx.split(model, nnx.Param, ...)`, gradients for the params, AdamW (linear warmup,
cosine decay) after global-norm clipping, an EMA of the params; params, optimizer state and EMA placed by the
`jaxflow.trainer.sharding.Layout` rules, the batch sharded over the data axis. The EMA weights are saved, through the key
map, as the folder's `transformer/` (`save_transformer`); with `--save-at`, also as SNAPSHOTS/STEP/transformer/ at each
of those steps of the one run (the learning-rate schedule spans all --steps).

Inputs (written by `python -m experiments.mini_ocr.prepare encode`): DATA/latents.npy (N, S, 64) float32 packed
normalised VAE means, DATA/index.npy (N,) the train word of each image, DATA/text.npz (embeds (P, L, D), mask
(P, L), neg_embeds (L, D), neg_mask (L,)), read by `WordFeed`. `pretrain` takes any feed of that interface (the mini
edit proof's, experiments/mini_edit/pretrain.py, adds the source images' latents and per-row negatives).

CLI: ``python -m experiments.mini_ocr.pretrain --pipeline OUT/pipeline --data OUT/data --steps N [--batch 256]
[--max-minutes 8] [--dtype bfloat16] [--save-at 500,1000 --snapshots OUT/snapshots]``.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Collection
from pathlib import Path

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxflow.nn.config import ModelOptions
from jaxflow.families.qwen_image.loading import load_transformer, save_transformer
from jaxflow.families.qwen_image.transformer import QwenImageTransformer
from jaxflow.trainer.sharding import Layout, ShardingConfig
from jaxflow_bridge.contract.schedule import calculate_shift
from jaxflow_bridge.families.qwen_image.spec import pixels_per_token
from experiments.mini_ocr.render import HEIGHT, WIDTH


@flax.struct.dataclass
class PretrainState:
    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState
    ema: nnx.State


def shift_mu(scheduler_config: dict, tokens: int) -> float:
    c = scheduler_config
    return calculate_shift(tokens, c["base_image_seq_len"], c["max_image_seq_len"], c["base_shift"], c["max_shift"])


def sample_sigma(key, batch: int, mu: float) -> jax.Array:
    """Logit-normal sigma, exponentially time-shifted by mu (diffusers' `time_shift_type="exponential"`)."""
    s = jax.nn.sigmoid(jax.random.normal(key, (batch,)))
    return math.exp(mu) / (math.exp(mu) + (1 / s - 1))


def optimizer(lr: float, steps: int, warmup: int = 200, clip: float = 1.0) -> optax.GradientTransformation:
    warmup = min(warmup, max(steps // 10, 1))
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), end_value=lr / 10)
    return optax.chain(optax.clip_by_global_norm(clip), optax.adamw(schedule, weight_decay=0.0))


def make_step(model, tx, grid_hw, mu: float, p_uncond: float, ema_decay: float, layout: Layout | None = None):
    """(init() -> state, step(state, batch, neg, key) -> (state, loss)); `state` is donated. batch: x0 (B, S, C),
    txt (B, L, D), mask (B, L), and optionally refs (B, R, S, C) (an edit model's reference latents, passed to the
    model as `refs`) and neg_txt (B, L, D), neg_mask (B, L) (each row's own negative conditioning); neg: (txt
    (L, D), mask (L,)) the negative prompt shared by all rows, or None when the batch holds each row's."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def init(params):
        params = jax.tree.map(jnp.copy, params)
        return PretrainState(jnp.zeros((), jnp.int32), params, tx.init(params), jax.tree.map(jnp.copy, params))

    def loss_fn(params, rest, batch, neg, key):
        x0, txt, mask = batch["x0"], batch["txt"], batch["mask"]
        k_sigma, k_noise, k_drop = jax.random.split(key, 3)
        sigma = sample_sigma(k_sigma, x0.shape[0], mu)
        eps = jax.random.normal(k_noise, x0.shape, x0.dtype)
        drop = jax.random.bernoulli(k_drop, p_uncond, (x0.shape[0],))
        neg_txt, neg_mask = (batch["neg_txt"], batch["neg_mask"]) if neg is None else (neg[0][None], neg[1][None])
        txt = jnp.where(drop[:, None, None], neg_txt, txt)
        mask = jnp.where(drop[:, None], neg_mask, mask)
        xt = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * eps
        refs = {"refs": batch["refs"]} if "refs" in batch else {}
        v = nnx.merge(graphdef, params, rest)(xt, sigma, txt, mask, grid_hw, **refs)
        return jnp.mean((v.astype(jnp.float32) - (eps - x0)) ** 2)

    def step(state, rest, batch, neg, key):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, rest, batch, neg, jax.random.fold_in(key, state.step))
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        ema = jax.tree.map(lambda e, p: ema_decay * e + (1 - ema_decay) * p, state.ema, params)
        return PretrainState(state.step + 1, params, opt_state, ema), loss

    if layout is None:
        init_jit, step_jit, put = jax.jit(init), jax.jit(step, donate_argnums=0), lambda b: jax.tree.map(jnp.asarray, b)
    else:
        state_sh = layout.tree_shardings(jax.eval_shape(init, params))
        rest = jax.device_put(rest, layout.tree_shardings(rest))
        params = jax.device_put(params, layout.tree_shardings(params))
        one = layout.replicated
        init_jit = jax.jit(init, out_shardings=state_sh)
        step_jit = jax.jit(step, in_shardings=(state_sh, layout.tree_shardings(rest), layout.batch_sharding, one, one),
                           out_shardings=(state_sh, one), donate_argnums=0)
        put = layout.put_batch
    return (lambda: init_jit(params)), (lambda state, batch, neg, key: step_jit(state, rest, put(batch), neg, key))


class WordFeed:
    """The mini OCR pretraining feed: images of train words, each conditioned on its word's prompt; one negative
    prompt for all (`neg`). `size` rows, each of `tokens` latent tokens; `batch(rows)` is `make_step`'s batch."""

    model_type = QwenImageTransformer

    def __init__(self, data: Path):
        text = np.load(data / "text.npz")
        self.latents, self.index = np.load(data / "latents.npy", mmap_mode="r"), np.load(data / "index.npy")
        self.embeds, self.mask = text["embeds"], text["mask"]
        self.neg = (jnp.asarray(text["neg_embeds"]), jnp.asarray(text["neg_mask"]))
        self.size, self.tokens = len(self.index), self.latents.shape[1]

    def batch(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        words = self.index[rows]
        return dict(x0=np.asarray(self.latents[rows]), txt=self.embeds[words], mask=self.mask[words])


def pretrain(pipeline: Path, data, steps: int, batch: int = 256, lr: float = 3e-4, dtype: str = "bfloat16",
             p_uncond: float = 0.1, ema_decay: float = 0.999, seed: int = 0, max_minutes: float | None = None,
             log_every: int = 100, log=print, save_at: Collection[int] = (),
             snapshots: Path | None = None) -> list[dict]:
    """Train from the folder's transformer weights and write the EMA weights back; returns the loss log. `data`: the
    mini OCR data folder (read by `WordFeed`) or a feed of its interface. After each step in `save_at`, the EMA
    weights also go to `snapshots`/STEP/transformer/."""
    feed = WordFeed(data) if isinstance(data, Path) else data
    layout = Layout.create(ShardingConfig())
    if batch % layout.batch_devices:
        raise ValueError(f"--batch {batch} must be a multiple of the {layout.batch_devices} devices")
    model = load_transformer(pipeline / "transformer", ModelOptions(dtype=dtype, param_dtype="float32"),
                             sharding=layout.sharding_fn, model_type=feed.model_type)
    grid_hw = _grid(pipeline, feed.tokens)
    scheduler = json.loads((pipeline / "scheduler" / "scheduler_config.json").read_text())
    mu = shift_mu(scheduler, grid_hw[0] * grid_hw[1])
    init, step = make_step(model, optimizer(lr, steps), grid_hw, mu, p_uncond, ema_decay, layout)
    state, key = init(), jax.random.key(seed)
    rng, history, start, window = np.random.default_rng(seed), [], time.perf_counter(), []
    for i in range(steps):
        state, loss = step(state, feed.batch(np.sort(rng.integers(0, feed.size, batch))), feed.neg, key)
        window.append(loss)
        elapsed = time.perf_counter() - start
        over = max_minutes is not None and elapsed > 60 * max_minutes
        if (i + 1) % log_every == 0 or i + 1 == steps or over:
            history.append(dict(step=i + 1, loss=float(np.mean(jax.device_get(window))), seconds=round(elapsed, 1)))
            window = []
            log(f"pretrain step {i + 1}/{steps} loss {history[-1]['loss']:.4f} ({elapsed:.0f}s)")
        if i + 1 in save_at:
            nnx.update(model, state.ema)  # the model is only read here and at the end: the next step donates state
            log(f"pretrain: snapshot -> {save_transformer(model, snapshots / str(i + 1) / 'transformer')}")
        if over:
            log(f"pretrain: stopped at step {i + 1} after {max_minutes} min")
            break
    nnx.update(model, state.ema)
    save_transformer(model, pipeline / "transformer")
    return history


def _grid(pipeline: Path, tokens: int) -> tuple[int, int]:
    """The packed token grid of the mini images (`pixels_per_token` of the pipeline's VAE)."""
    factor = pixels_per_token(json.loads((pipeline / "vae" / "config.json").read_text()))
    grid = (HEIGHT // factor, WIDTH // factor)
    if grid[0] * grid[1] != tokens:
        raise ValueError(f"latents have {tokens} tokens, but {HEIGHT}x{WIDTH} images give {grid}: re-run "
                         f"`python -m experiments.mini_ocr.prepare encode` for this folder")
    return grid


def main(argv=None, feed=WordFeed, description: str = __doc__) -> None:
    """The CLI over `feed(--data)` (the mini edit proof's pretraining passes its own feed and docstring)."""
    p = argparse.ArgumentParser(description=description.splitlines()[0])
    p.add_argument("--pipeline", type=Path, required=True, help="the diffusers folder; transformer/ is replaced")
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--p-uncond", type=float, default=0.1)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=None, help="stop (and save) after this long")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--save-at", type=lambda s: {int(x) for x in s.split(",")}, default=set(),
                   help="comma-separated steps after which the EMA weights also go to --snapshots/STEP/transformer/")
    p.add_argument("--snapshots", type=Path, default=None, help="the snapshots folder (with --save-at)")
    args = p.parse_args(argv)
    if args.save_at and (args.snapshots is None or not all(1 <= s <= args.steps for s in args.save_at)):
        p.error(f"--save-at {','.join(map(str, sorted(args.save_at)))} needs --snapshots DIR and steps in 1..--steps "
                f"({args.steps})")
    history = pretrain(args.pipeline, feed(args.data), args.steps, args.batch, args.lr, args.dtype, args.p_uncond,
                       args.ema, args.seed, args.max_minutes, args.log_every, save_at=args.save_at,
                       snapshots=args.snapshots)
    (args.data / "pretrain_loss.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))


if __name__ == "__main__":
    main()
