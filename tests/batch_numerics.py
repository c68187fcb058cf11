"""Two batches of the same samples computed in other batches (packed or not, padded apart): equal up to float32's
reordered sums, with a bound derived from the models (`reordering_bound`)."""
import dataclasses

import numpy as np
import torch

from jaxflow_bridge.contract.trajectory import TrajectoryBatch


def terms(layer: torch.nn.Module) -> int:
    """The terms of each sum a linear or convolution computes (0 for any other module)."""
    if isinstance(layer, torch.nn.Linear):
        return layer.in_features
    if isinstance(layer, torch.nn.modules.conv._ConvNd):
        return layer.in_channels // layer.groups * int(np.prod(layer.kernel_size))
    return 0


def reordering_bound(module: torch.nn.Module, passes: float = 1) -> float:
    """The relative error float32 results may differ by when `module`'s sums run in another order (another batch,
    more padding) over `passes` chained calls: K u per contraction (the standard bound for a sum of K terms, u
    float32's unit roundoff; K the widest layer's, `terms`), as many contractions chained as it has such layers."""
    sums = [k for k in map(terms, module.modules()) if k]
    return passes * len(sums) * max(sums) * float(np.finfo(np.float32).eps) / 2


def assert_same_samples(got: TrajectoryBatch, want: TrajectoryBatch, pipeline, sp) -> None:
    """Every field equal, the float ones within the batch's numerics (`reordering_bound`): text embeds one
    text-encoder pass, latents and log-probs `steps` transformer passes, each CFG velocity (1 + 2 x scale) times
    one's error, an edit model's reference latents one VAE pass; images within one level (a value the latents move
    across a rounding boundary of the VAE's uint8)."""
    text = reordering_bound(pipeline.text_encoder)
    steps = reordering_bound(pipeline.transformer, sp.num_inference_steps * (1 + 2 * sp.true_cfg_scale))
    tolerance = {"prompt_embeds": text, "negative_prompt_embeds": text, "latents": steps, "log_probs": steps,
                 "reference_latents": reordering_bound(pipeline.vae)}
    for f in dataclasses.fields(TrajectoryBatch):
        x, y = getattr(got, f.name), getattr(want, f.name)
        if f.name == "images":
            assert x.shape == y.shape and np.abs(x.astype(int) - y.astype(int)).max() <= 1
        elif f.name in tolerance:
            scale = max(1.0, float(np.abs(np.asarray(y, np.float32)).max(initial=0)))
            np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=0,
                                       atol=tolerance[f.name] * scale, err_msg=f.name)
        elif isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), f.name
        else:
            assert x == y, f.name
