"""Every process's side of a step: the model, the jitted step on this process's rows of the train batch."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxflow import config as config_lib
from jaxflow.models.config import QwenImageConfig
from jaxflow.models.loading import load_transformer
from jaxflow.models.random_init import random_transformer
from jaxflow.sharding import Layout


def grid_hw(folder: Path, cfg) -> tuple[int, int]:
    """Packed latent grid: the VAE downsamples by 2**len(temperal_downsample), then 2x2 patches are packed."""
    vae = json.loads((folder / "vae" / "config.json").read_text())
    factor = 2 * 2 ** len(vae["temperal_downsample"])
    if cfg.sample.height % factor or cfg.sample.width % factor:
        raise ValueError(f"config.sample.height/width must be multiples of {factor} for this VAE")
    return cfg.sample.height // factor, cfg.sample.width // factor


def build_model(cfg, folder: Path, spec, layout: Layout):
    """The trainer's transformer: base weights from `folder`, or drawn from `seed` with `model.init=random`."""
    opts, kw = config_lib.model_options(cfg), dict(sharding=layout.sharding_fn, seed=cfg.seed)
    if cfg.model.init == "random":
        return random_transformer(QwenImageConfig.from_json(folder / "config.json"), opts, spec, **kw)
    return load_transformer(folder, opts, spec, **kw)


_DESC_BYTES = 1 << 14  # the broadcast description of a train batch (keys, shapes, dtypes) as JSON


def share_batch(batch: dict | None) -> dict[str, np.ndarray]:
    """Process 0's per-sample `batch` (host arrays), on every process: a fixed-size description (keys, shapes,
    dtypes) is broadcast first, so the other processes (which pass None) can build same-sized zero buffers, then the
    arrays themselves as raw bytes (any dtype, bfloat16 and int64 included, arrives bit-exact)."""
    import ml_dtypes
    from jax.experimental import multihost_utils
    desc = np.zeros(_DESC_BYTES, np.uint8)
    if batch is not None:
        text = json.dumps({k: [list(v.shape), v.dtype.name] for k, v in batch.items()}).encode()
        if len(text) > _DESC_BYTES:
            raise ValueError(f"train batch description is {len(text)} bytes > {_DESC_BYTES}")
        desc[:len(text)] = np.frombuffer(text, np.uint8)
    desc = np.asarray(multihost_utils.broadcast_one_to_all(desc))
    spec = json.loads(desc.tobytes().rstrip(b"\0").decode())
    dtypes = {k: np.dtype(getattr(ml_dtypes, d)) if hasattr(ml_dtypes, d) else np.dtype(d)
              for k, (_, d) in spec.items()}
    if batch is not None:
        payload = {k: np.ascontiguousarray(batch[k]).reshape(-1).view(np.uint8) for k in spec}
    else:
        payload = {k: np.zeros(int(np.prod(shape)) * dtypes[k].itemsize, np.uint8) for k, (shape, _) in spec.items()}
    payload = multihost_utils.broadcast_one_to_all(payload)
    return {k: np.asarray(payload[k]).view(dtypes[k]).reshape(spec[k][0]) for k in spec}
