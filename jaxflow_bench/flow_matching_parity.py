"""Algorithm parity of the flow-matching losses on CPU: DiffusionNFT's and AWM's loss of one noised timestep and its
gradient with respect to the trained velocity (float32) against the reference transcriptions in
tests/reference_transcriptions.py (NVlabs' DiffusionNFT objective in float32, AWM's official trainer in float64).
`jaxflow_bench.algorithm_parity` writes them with the other algorithms' figures."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxflow.algorithms import awm, nft
from jaxflow_bench.parity_differences import differences
from tests import reference_transcriptions as ref

NFT_BETAS = (1.0, 0.1)  # train.nft.beta: NVlabs' SD3 value and verl-omni's recipe's for the default family
NFT_KL, ADV_CLIP = 0.3, 5.0
AWM = {"power": 0.25, "adv_clip": 2.0, "adv_max": 1.0, "clip_range": 1.0}
AWM_KL = 0.003


def nft_inputs(seed: int = 0) -> dict:
    """float32 x0, noise, v, v_old, v_ref (5, 6, 4); timesteps and advantages covering both clips, r = 1/2 and t = 1."""
    r = np.random.default_rng(seed)
    arrays = dict(zip(("x0", "noise", "v", "v_old", "v_ref"), (r.normal(size=(5, 6, 4)).astype(np.float32)
                                                                for _ in range(5))))
    return {**arrays, "t": np.float32([0.9, 0.5, 0.2, 1.0, 0.05]), "adv": np.float32([-7.0, -1.0, 0.0, 2.5, 6.0])}


def _nft_project(x: dict, beta: float):
    def loss(v):
        xt = nft.noised(x["x0"], x["noise"], x["t"])
        terms = nft.loss_terms(v, x["v_old"], x["x0"], xt, x["t"], x["adv"], nft_beta=beta, adv_clip=ADV_CLIP,
                               v_ref=x["v_ref"])
        return jnp.mean(terms["policy"]) + NFT_KL * jnp.mean(terms["kl"])

    value, grad = jax.value_and_grad(loss)(jnp.asarray(x["v"]))
    return np.float32(value), (np.asarray(grad),)


def _nft_reference(x: dict, beta: float):
    v = torch.tensor(x["v"], requires_grad=True)
    policy, kl = ref.nvlabs_nft_loss(v, *(torch.tensor(x[k]) for k in ("v_old", "v_ref", "x0", "noise", "t", "adv")),
                                     beta, ADV_CLIP)
    loss = policy.mean() + NFT_KL * kl.mean()
    loss.backward()
    return np.float32(loss.item()), (v.grad.numpy(),)


def awm_inputs(seed: int = 0) -> dict:
    """float32 v, v_ref, x0, noise (6, 16, 8), timesteps in (0.05, 0.95), advantages of scale 3 (some past the clip)."""
    r = np.random.default_rng(seed)
    arrays = dict(zip(("v", "v_ref", "x0", "noise"), (r.standard_normal((6, 16, 8)).astype(np.float32)
                                                      for _ in range(4))))
    return {**arrays, "t": r.uniform(0.05, 0.95, 6).astype(np.float32),
            "adv": (3 * r.standard_normal(6)).astype(np.float32)}


def _awm_project(x: dict):
    def loss(v):
        terms = awm.loss_terms(v, *(jnp.asarray(x[k]) for k in ("x0", "noise", "t", "adv")),
                               v_ref=jnp.asarray(x["v_ref"]), **AWM)
        return jnp.mean(terms["policy"]) + AWM_KL * jnp.mean(terms["kl"])

    value, grad = jax.value_and_grad(loss)(jnp.asarray(x["v"]))
    return np.float32(value), (np.asarray(grad),)


def _awm_reference(x: dict):
    v = torch.tensor(x["v"], dtype=torch.float64, requires_grad=True)
    loss = ref.awm_official_loss(v, *(torch.tensor(x[k], dtype=torch.float64)
                                      for k in ("v_ref", "x0", "noise", "t", "adv")), beta=AWM_KL, **AWM)
    loss.backward()
    return loss.item(), (v.grad.numpy(),)


def figures(seed: int = 0) -> dict:
    """{algorithm/comparison: differences} of DiffusionNFT (each beta) and AWM."""
    x = nft_inputs(seed)
    out = {f"nft_beta{beta:g}_vs_nvlabs": differences(_nft_project(x, beta), _nft_reference(x, beta))
           for beta in NFT_BETAS}
    x = awm_inputs(seed)
    return {**out, "awm_vs_official": differences(_awm_project(x), _awm_reference(x))}
