"""The mini model's VAE: diffusers' `AutoencoderKLQwenImage` at a small config, trained on the rendered signs.

Loss: mean squared error of the reconstruction in [-1, 1] plus `kl_weight` x the mean KL of the diagonal Gaussian
posterior to N(0, 1). After training, `set_latent_stats` writes the per-channel mean/std of the posterior means
over the data into the config's `latents_mean`/`latents_std`, which the pipeline normalises latents with.
Packing (`pack`) is the inverse of `RolloutPipeline.decode`: (16, 2h, 2w) -> (h*w, 64) tokens of 2x2 patches.
"""
from __future__ import annotations

import time

import numpy as np
import torch

# Spatial factor 4 (two downsamples), 16 latent channels as the released model; about 1.4M parameters.
MINI_VAE_CONFIG = dict(base_dim=32, z_dim=16, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
                       latents_mean=[0.0] * 16, latents_std=[1.0] * 16)


def build_vae(seed: int = 0, **overrides):
    from diffusers import AutoencoderKLQwenImage

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoencoderKLQwenImage(**{**MINI_VAE_CONFIG, **overrides})


def to_video(images: np.ndarray, device) -> torch.Tensor:
    """uint8 (B, H, W, 3) -> float32 (B, 3, 1, H, W) in [-1, 1]."""
    x = torch.from_numpy(np.ascontiguousarray(images)).to(device).permute(0, 3, 1, 2).float() / 127.5 - 1
    return x[:, :, None]


def to_uint8(video: torch.Tensor) -> np.ndarray:
    return ((video[:, :, 0].clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def random_crops(rng, images: np.ndarray, size: tuple[int, int] | None) -> np.ndarray:
    """One random (h, w) crop per image (the VAE is convolutional: crops train it as whole images do, cheaper)."""
    if size is None:
        return images
    h, w = size
    ys = rng.integers(0, images.shape[1] - h + 1, len(images))
    xs = rng.integers(0, images.shape[2] - w + 1, len(images))
    return np.stack([im[y:y + h, x:x + w] for im, y, x in zip(images, ys, xs)])


def train_vae(vae, images: np.ndarray, steps: int, batch_size: int = 32, lr: float = 3e-4,
              kl_weight: float = 1e-6, seed: int = 0, device="cpu", max_seconds: float | None = None,
              crop: tuple[int, int] | None = None, log=print) -> list[float]:
    """Train in place (AdamW, cosine decay) on random `crop`s (None: whole images); returns the loss per step.
    Stops early after `max_seconds`."""
    vae.to(device).train()
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    rng = np.random.default_rng(seed)
    losses, start = [], time.perf_counter()
    for step in range(steps):
        x = to_video(random_crops(rng, images[rng.integers(0, len(images), batch_size)], crop), device)
        post = vae.encode(x).latent_dist
        recon = vae.decode(post.sample()).sample
        loss = torch.mean((recon - x) ** 2) + kl_weight * post.kl().mean() / post.mean[0].numel()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == steps - 1:
            log(f"vae step {step + 1}/{steps} loss {losses[-1]:.5f} ({time.perf_counter() - start:.0f}s)")
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            log(f"vae: stopped at step {step + 1} after {max_seconds:.0f}s")
            break
    vae.eval()
    return losses


@torch.no_grad()
def posterior_means(vae, images: np.ndarray, batch_size: int = 256, device="cpu") -> torch.Tensor:
    """(N, 16, 1, h, w) float32 posterior means (unnormalised), on the CPU."""
    out = [vae.encode(to_video(images[i:i + batch_size], device)).latent_dist.mean.float().cpu()
           for i in range(0, len(images), batch_size)]
    return torch.cat(out)


def set_latent_stats(vae, means: torch.Tensor) -> None:
    """Per-channel mean/std of `means` into the VAE config (saved with it)."""
    flat = means.transpose(0, 1).reshape(means.shape[1], -1).double()
    vae.register_to_config(latents_mean=[round(float(v), 6) for v in flat.mean(1)],
                           latents_std=[round(float(v), 6) for v in flat.std(1)])


def pack(means: torch.Tensor, vae) -> np.ndarray:
    """(N, C, 1, 2h, 2w) posterior means -> (N, h*w, 4C) float32 normalised packed tokens (the transformer's x0)."""
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    z = ((means - mean) / std)[:, :, 0]
    n, c, hh, ww = z.shape
    z = z.reshape(n, c, hh // 2, 2, ww // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return z.reshape(n, (hh // 2) * (ww // 2), c * 4).numpy().astype(np.float32)


@torch.no_grad()
def reconstruct(vae, images: np.ndarray, batch_size: int = 256, device="cpu") -> np.ndarray:
    """uint8 reconstructions through the posterior means."""
    out = []
    for i in range(0, len(images), batch_size):
        post = vae.encode(to_video(images[i:i + batch_size], device)).latent_dist
        out.append(to_uint8(vae.decode(post.mean).sample))
    return np.concatenate(out)
