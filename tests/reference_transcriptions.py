"""Short transcriptions (torch, float32) of the reference functions the algorithm parity tests compare against;
written for these tests, each naming its repository, file and commit. Not product code."""
from __future__ import annotations

import math

import torch


def verl_omni_grpo_guard_loss(old_log_prob, log_prob, advantages, old_prev_sample_mean, prev_sample_mean, std_dev_t,
                              sqrt_dt, clip_ratio, adv_clip_max, rollout_is_weights=None):
    """verl-project/verl-omni verl_omni/trainer/diffusion/diffusion_algos.py `GRPOGuardLoss.compute_loss`
    (commit a1139bafffb5b9711f0a6b6edff8ecaa60bfff30): its loss, metrics left out."""
    advantages = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    sigma_t = std_dev_t.mean()
    sqrt_dt_mean = sqrt_dt.mean()
    scale = sqrt_dt_mean * sigma_t
    mean_diff_sq = (prev_sample_mean - old_prev_sample_mean).pow(2)
    if mean_diff_sq.ndim > 1:
        mean_diff_sq = mean_diff_sq.mean(dim=tuple(range(1, mean_diff_sq.ndim)))
    ratio = torch.exp((log_prob - old_log_prob + mean_diff_sq / (2 * scale ** 2)) * scale)
    per_elem = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio))
    if rollout_is_weights is not None:
        per_elem = per_elem * rollout_is_weights.detach()
    return torch.mean(per_elem) / sqrt_dt_mean ** 2


def flow_grpo_guard_policy_loss(old_log_prob, log_prob, advantages, old_prev_sample_mean, prev_sample_mean,
                                std_dev_t, sqrt_dt, clip_range, adv_clip_max):
    """yifan123/flow_grpo scripts/train_sd3_GRPO_Guard.py, the `config.rationorm` policy loss (lines 910-932; read at
    zhtmike/flow_grpo 9745241cf1101407e9b518dd4f10498092150522, upstream's tree). Its drift's
    `.mean(dim=tuple(range(1, log_prob.ndim)))` on a 1-D log_prob is `.mean(dim=())`: the mean over everything."""
    advantages = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    sigma_t = std_dev_t.mean()
    bias = (prev_sample_mean - old_prev_sample_mean).pow(2).mean(dim=tuple(range(1, log_prob.ndim)))
    bias = bias / (2 * (sqrt_dt.mean() * sigma_t) ** 2)
    ratio = torch.exp((log_prob - old_log_prob + bias) * (sqrt_dt.mean() * sigma_t))
    loss = torch.mean(torch.maximum(-advantages * ratio,
                                    -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)))
    return loss / sqrt_dt.mean() ** 2


def verl_token_rejection_mask(log_ratio, option, threshold):
    """volcengine/verl verl/trainer/ppo/rollout_corr_helper.py `compute_rollout_rejection_mask` (commit
    b178a3cd56f58b2d502255daba591e92833930a7), its token-level options on a dense (B, T) mask: 1 keep, 0 reject."""
    lr = torch.clamp(log_ratio, min=-20.0, max=20.0)
    if option == "token_k1":
        upper, lower = float(threshold), 1.0 / float(threshold)
        stat = -lr
        keep = (stat >= math.log(lower)) & (stat <= math.log(upper))
    elif option == "token_k2":
        keep = 0.5 * lr ** 2 <= threshold
    elif option == "token_k3":
        keep = torch.exp(lr) - 1.0 - lr <= threshold
    else:
        raise ValueError(option)
    return keep.to(log_ratio.dtype)


def verl_omni_bypass_flow_grpo_loss(log_prob, rollout_log_prob, advantages, clip_ratio, adv_clip_max, option,
                                    threshold, kl=None, kl_coef=0.0):
    """verl-project/verl-omni verl_omni/workers/utils/losses.py `diffusion_loss` with `_apply_bypass_rc` (one SDE
    step, (B,) log-probs as (B, 1) sequences, RS mask as a 0/1 weight) and diffusion_algos.py `FlowGRPOLoss`
    (commit a1139bafffb5b9711f0a6b6edff8ecaa60bfff30); the KL term added unweighted, as `diffusion_loss` does."""
    weights = verl_token_rejection_mask(log_prob.unsqueeze(-1).detach() - rollout_log_prob.unsqueeze(-1), option,
                                        threshold).squeeze(-1)
    advantages = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_prob - rollout_log_prob)
    per_elem = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio))
    loss = torch.mean(per_elem * weights.detach())
    return loss if kl is None else loss + kl_coef * torch.mean(kl)
