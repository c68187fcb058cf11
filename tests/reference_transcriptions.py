"""Short transcriptions (torch, float32 unless named) of the reference functions the algorithm parity tests compare
against; written for these tests, each naming its source (repository, file, and the commit where it was read). Not
product code."""
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


def flow_grpo_sd3_filtered_updates(samples, compute_log_prob, num_batches_per_epoch, gradient_accumulation_steps,
                                   clip_range, adv_clip_max, beta, perm, generator=None):
    """yifan123/flow_grpo scripts/train_sd3.py (commit ac4c86e8cae021841f1fde853d340e0db67690dd), lines 796-835 (the
    rows whose advantages are all 0 dropped, topped up with random such rows to a multiple of num_batches_per_epoch,
    shuffled and re-batched into num_batches_per_epoch micro-batches) and 868-933 (each timestep's loss; accelerate
    divides it by its accumulation steps, gradient_accumulation_steps x num_train_timesteps): one inner epoch on one
    process, the shuffle `perm` given. samples: (B, ...) tensors with advantages and log_probs (B, T);
    compute_log_prob(sample, j, adapter) -> (log_prob, prev_sample_mean, std_dev_t) stands for its
    `compute_log_prob` (adapter False: under `disable_adapter`). Returns each optimizer update's loss as it is
    backpropagated (the sum of its micro-steps' loss / accumulation steps)."""
    mask = samples["advantages"].abs().sum(dim=1) != 0
    num_batches = num_batches_per_epoch
    true_count = mask.sum()
    if true_count % num_batches != 0:
        false_indices = torch.where(~mask)[0]
        num_to_change = num_batches - (true_count % num_batches)
        if len(false_indices) >= num_to_change:
            random_indices = torch.randperm(len(false_indices), generator=generator)[:num_to_change]
            mask[false_indices[random_indices]] = True
    samples = {k: v[mask] for k, v in samples.items()}
    total_batch_size, num_timesteps = samples["log_probs"].shape
    samples = {k: v[perm] for k, v in samples.items()}
    batched = {k: v.reshape(-1, total_batch_size // num_batches, *v.shape[1:]) for k, v in samples.items()}
    batched = [dict(zip(batched, x)) for x in zip(*batched.values())]
    accumulation = gradient_accumulation_steps * num_timesteps
    updates, pending, micro_steps = [], 0.0, 0
    for sample in batched:
        for j in range(num_timesteps):
            log_prob, prev_sample_mean, std_dev_t = compute_log_prob(sample, j, True)
            advantages = torch.clamp(sample["advantages"][:, j], -adv_clip_max, adv_clip_max)
            ratio = torch.exp(log_prob - sample["log_probs"][:, j])
            unclipped_loss = -advantages * ratio
            clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
            policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
            if beta > 0:
                with torch.no_grad():
                    prev_sample_mean_ref = compute_log_prob(sample, j, False)[1]
                dims = tuple(range(1, prev_sample_mean.ndim))  # SD3's (B, C, H, W): (1, 2, 3)
                kl_loss = ((prev_sample_mean - prev_sample_mean_ref) ** 2).mean(dim=dims, keepdim=True) / (
                    2 * std_dev_t ** 2)
                loss = policy_loss + beta * torch.mean(kl_loss)
            else:
                loss = policy_loss
            pending = pending + loss / accumulation
            micro_steps += 1
            if micro_steps % accumulation == 0:
                updates.append(pending)
                pending = 0.0
    return updates


def verl_rejection_mask(log_ratio, option, threshold):
    """volcengine/verl verl/trainer/ppo/rollout_corr_helper.py `compute_rollout_rejection_mask` (commit
    e1904109a3a83d7c911baaf8998b9188b4cf7874), one option, a single threshold (k1: lower 1/t), every token valid:
    (B, T) 0/1 mask, sequence-level options (seq_sum/seq_mean/seq_max) over the T axis."""
    lr = torch.clamp(log_ratio, min=-20.0, max=20.0)
    stats = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": torch.exp(lr) - 1.0 - lr}
    k = option[-2:]
    stat = stats[k]
    if option.startswith("seq_sum"):
        stat = stat.sum(dim=-1, keepdim=True)
    elif option.startswith("seq_mean"):
        stat = stat.mean(dim=-1, keepdim=True)
    elif option.startswith("seq_max"):
        stat = stat.max(dim=-1, keepdim=True).values
    if k == "k1":
        keep = (stat >= math.log(1.0 / float(threshold))) & (stat <= math.log(float(threshold)))
    else:
        keep = stat <= threshold
    return keep.expand_as(log_ratio).to(log_ratio.dtype)


def verl_is_weights(log_ratio, level, threshold):
    """volcengine/verl verl/trainer/ppo/rollout_corr_helper.py `compute_rollout_correction_weights` (commit
    e1904109a3a83d7c911baaf8998b9188b4cf7874), every token valid, no batch normalization: (B, T) truncated weights."""
    if level == "token":
        w = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    elif level == "sequence":
        w = torch.exp(torch.clamp(log_ratio.sum(dim=-1, keepdim=True), min=-20.0, max=20.0)).expand_as(log_ratio)
    else:
        raise ValueError(level)
    return w.clamp(max=threshold).detach()


def verl_decoupled_flow_grpo_loss(log_prob, old_log_prob, rollout_log_prob, advantages, clip_ratio, adv_clip_max,
                                  rollout_is, is_threshold, rollout_rs, rs_threshold):
    """verl's decoupled mode on (B, T) log-probs (T a sample's window steps): IS weights and the rejection mask
    from old_log_prob - rollout_log_prob (`compute_rollout_correction_and_rejection_mask`, as above), the PPO terms
    (verl-omni diffusion_algos.py `FlowGRPOLoss`, commit a1139bafffb5b9711f0a6b6edff8ecaa60bfff30) multiplied by
    the IS weights (core_algos' `pg_losses * rollout_is_weights`) and the mask, averaged over every (sample, step)
    (the rejected kept in the denominator, as verl-omni's bypass weights them)."""
    log_ratio = old_log_prob - rollout_log_prob
    weights = torch.ones_like(log_ratio)
    if rollout_is is not None:
        weights = weights * verl_is_weights(log_ratio, rollout_is, is_threshold)
    if rollout_rs is not None:
        weights = weights * verl_rejection_mask(log_ratio, rollout_rs, rs_threshold)
    advantages = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_prob - old_log_prob)
    per_elem = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio))
    return torch.mean(per_elem * weights.detach())


def nvlabs_nft_dpm2_sampling(v_pred_fn, z, sigmas):
    """NVlabs/DiffusionNFT flow_grpo/diffusers_patch/solver.py `run_sampling(..., solver="dpm2", determistic=True)`
    (commit 24af5556): `dpm_step` at order 2 with its `DPMState`, `convert_model_output` (x0 = x - sigma v),
    `ddim_update` at eta 0 for the first and the last step and `multistep_dpm_solver_second_order_update` between,
    the lambdas in float64 (`sigmas.to(torch.float64)`). Returns the final latents and every step's latents."""
    s64 = sigmas.to(torch.float64)
    lam = lambda s: torch.log(1 - s) - torch.log(s)  # noqa: E731  (alpha = 1 - sigma, sigma = sigma)
    n, outputs, all_latents = len(sigmas) - 1, [], [z]
    for i in range(n):
        x0 = z.float() - sigmas[i] * v_pred_fn(z, sigmas[i]).float()
        outputs = (outputs + [x0])[-2:]
        t, s = s64[i + 1], s64[i]
        if i == 0 or i == n - 1:
            noise_pred = (z.float() - (1 - s) * x0) / s
            z = (1 - t) * x0 + torch.sqrt(t ** 2) * noise_pred
        else:
            h, h_0 = lam(t) - lam(s), lam(s) - lam(s64[i - 1])
            d0, d1 = outputs[-1], (1.0 / (h_0 / h)) * (outputs[-1] - outputs[-2])
            z = (t / s) * z.float() - ((1 - t) * (torch.exp(-h) - 1.0)) * d0 \
                - 0.5 * ((1 - t) * (torch.exp(-h) - 1.0)) * d1
        z = z.to(torch.float32)
        all_latents.append(z)
    return z, all_latents


def mixgrpo_flash_sampling(v_pred_fn, z, sigmas, deterministic, noises, eta):
    """Tencent-Hunyuan/MixGRPO fastvideo/utils/sampling_utils.py `run_sample_step` (commit d270daf3) as its Flash
    recipe runs it (scripts/finetune/finetune_flux_grpo_MixGRPO_Flash.sh: dpm_algorithm_type "dpmsolver++",
    dpm_apply_strategy "post", dpm_solver_order 2, dpm_solver_type "midpoint", flow_grpo_sampling, sde_type "sde"),
    with the schedule after the window not rebuilt (dpm_post_compress_ratio 1) and `noises[i]` standing in for step
    i's randn_tensor. Steps up to the last non-deterministic one are `flow_grpo_step` (x + dt v where deterministic),
    each pushing its x0 = x - sigma v into the `DPMState`; later steps are `dpm_step`: first order (DDIM) while the
    state holds fewer than one output or at the last step, else the midpoint second-order update with the
    state's last two outputs, in the schedule's dtype. Returns the final latents, every step's latents, log-probs."""
    last = max(i for i, d in enumerate(deterministic) if not d)
    n, sigma_max = len(sigmas) - 1, sigmas[1]
    lam = lambda s: torch.log(1 - s) - torch.log(s)  # noqa: E731  (_sigma_to_alpha_sigma_t: alpha = 1 - sigma)
    outputs, lower_order_nums, all_latents, log_probs = [None, None], 0, [z], []
    for i in range(n):
        v = v_pred_fn(z, sigmas[i]).float()
        z = z.float()
        sigma, sigma_prev = sigmas[i], sigmas[i + 1]
        x0 = z - sigma * v
        outputs = [outputs[1], x0]
        if i <= last:
            dt = sigma_prev - sigma
            std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * eta
            mean = z * (1 + std_dev_t ** 2 / (2 * sigma) * dt) + v * (1 + std_dev_t ** 2 * (1 - sigma) / (2 * sigma)) * dt
            step_std = std_dev_t * torch.sqrt(-dt)
            z_next = mean + step_std * noises[i]
            if deterministic[i]:
                z_next = z + dt * v
            log_prob = -((z_next - mean) ** 2) / (2 * step_std ** 2) - torch.log(step_std) \
                - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
            log_probs.append(log_prob.mean(dim=tuple(range(1, log_prob.ndim))))
            z = z_next
        else:
            h = lam(sigma_prev) - lam(sigma)
            alpha_t = 1 - sigma_prev
            if lower_order_nums < 1 or i == n - 1:
                z = (sigma_prev / sigma) * z - (alpha_t * (torch.exp(-h) - 1.0)) * x0
            else:
                r0 = (lam(sigma) - lam(sigmas[i - 1])) / h
                d0, d1 = outputs[1], (1.0 / r0) * (outputs[1] - outputs[0])
                z = (sigma_prev / sigma) * z - (alpha_t * (torch.exp(-h) - 1.0)) * d0 \
                    - 0.5 * (alpha_t * (torch.exp(-h) - 1.0)) * d1
            log_probs.append(torch.zeros(z.shape[0]))  # dpm_step's log-prob of a deterministic step: not used
        lower_order_nums = min(lower_order_nums + 1, 2)
        all_latents.append(z)
    return z, all_latents, log_probs


def nvlabs_nft_loss(v, v_old, v_ref, x0, noise, t, adv, beta, adv_clip):
    """DiffusionNFT's objective written out in torch (arXiv 2509.16117, eq. of the implicit policies; the adaptive
    weight as its SD3 trainer NVlabs/DiffusionNFT scripts/train_nft_sd3.py computes it, in float64 without
    gradient): per-sample (policy, kl)."""
    t = t.view(-1, 1, 1)
    xt = (1 - t) * x0 + t * noise
    r = torch.clamp(torch.clamp(adv, -adv_clip, adv_clip) / adv_clip / 2 + 0.5, 0, 1)

    def loss(pred):
        x0_hat = xt - t * pred
        with torch.no_grad():
            w = (x0_hat.double() - x0.double()).abs().mean(dim=(1, 2), keepdim=True).clip(min=1e-5)
        return ((x0_hat - x0) ** 2 / w).mean(dim=(1, 2))

    pos = loss(beta * v + (1 - beta) * v_old)
    neg = loss((1 + beta) * v_old - beta * v)
    policy = (r * pos / beta + (1 - r) * neg / beta) * adv_clip
    kl = ((v - v_ref) ** 2).mean(dim=(1, 2))
    return policy, kl


def awm_official_loss(v, v_ref, x0, noise, t, adv, *, power, adv_clip, adv_max, clip_range, beta):
    """Transcribed from scxue/advantage_weighted_matching @ be5137232e33a21b449ed65a533211d0deb97ed8,
    advantage_weighted_matching/scripts/train_sd3_awm.py: compute_log_prob_awm (weighting 'ghuber') and the
    training loop's loss (loss_type 'exp_first', on-policy old_log_probs = log_prob.detach(), kl_weight 'Uniform')
    for one timestep, in float64 as there."""
    lp = -(v - (noise - x0)) ** 2
    lp = lp.mean(dim=tuple(range(1, lp.ndim)))
    lp = -(torch.pow(-lp + 1e-10, power) - torch.pow(torch.tensor(1e-10, dtype=lp.dtype), power)) * t / power
    a = torch.clamp(adv, -adv_clip, adv_clip) / adv_clip * adv_max
    ratio = torch.exp(lp - lp.detach())
    policy = torch.mean(torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - clip_range, 1 + clip_range)))
    kl = ((v - v_ref) ** 2).mean(dim=tuple(range(1, v.ndim))).mean()
    return policy + beta * kl


class MixGRPOTrainingStates:
    """Transcribed from Tencent-Hunyuan/MixGRPO @ e5cdd6a427778d8c8b2e7a48ce16972141adbe7c,
    fastvideo/utils/grpo_states.py: GRPOTrainingStates, sample_strategy 'progressive' with prog_overlap and
    roll_back (scripts/finetune/finetune_flux_grpo_MixGRPO.sh), max_timesteps = sampling_steps - 2
    (fastvideo/train_grpo_flux.py); the window of an iteration is read before update_iteration."""

    def __init__(self, interval, size, max_timesteps, stride):
        self.interval, self.size, self.max_t, self.stride = interval, size, max_timesteps, stride
        self.cur, self.it = 0, 0

    def window(self):
        return list(range(self.cur, min(self.cur + self.size, self.max_t)))

    def update(self):
        self.it += 1
        if self.it >= self.interval:
            self.it = 0
            self.cur += self.stride
        if self.cur > self.max_t:
            self.cur, self.it = 0, 0


def flow_grpo_sde_step_log_prob(v, x, prev_sample, sigma, sigma_prev, sigma_max, noise_level, sde_type):
    """yifan123/flow_grpo flow_grpo/diffusers_patch/sd3_sde_with_logprob.py `sde_step_with_logprob` (commit
    54809b5fcf4d3930d2a17fa553928704bd0b719e) with prev_sample given, per-sample sigma and sigma_prev (B,) in place
    of the scheduler's step indices: (log_prob (B,), prev_sample_mean), float32."""
    v, x = v.float(), x.float()
    sigma, sigma_prev = (s.view(-1, *([1] * (x.ndim - 1))) for s in (sigma, sigma_prev))
    dt = sigma_prev - sigma
    if sde_type == "sde":
        std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
        mean = x * (1 + std_dev_t ** 2 / (2 * sigma) * dt) + v * (1 + std_dev_t ** 2 * (1 - sigma) / (2 * sigma)) * dt
        step_std = std_dev_t * torch.sqrt(-1 * dt)
        log_prob = -((prev_sample.detach() - mean) ** 2) / (2 * step_std ** 2) - torch.log(step_std) \
            - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    elif sde_type == "cps":
        std_dev_t = sigma_prev * math.sin(noise_level * math.pi / 2)
        mean = (x - sigma * v) * (1 - sigma_prev) + (x + v * (1 - sigma)) * torch.sqrt(sigma_prev ** 2 - std_dev_t ** 2)
        log_prob = -((prev_sample.detach() - mean) ** 2)
    else:
        raise ValueError(sde_type)
    return log_prob.mean(dim=tuple(range(1, log_prob.ndim))), mean
