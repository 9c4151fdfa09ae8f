"""The denoising loss of one batch: noise, timesteps, target, min-SNR weights, prior-preservation weight.

Uses the scheduler's own `add_noise` / `get_velocity` and diffusers' `compute_snr`; what is written
here is only the glue those lack (sampling cached latent distributions, per-sample weighting).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sample_latents(mean: torch.Tensor, std: torch.Tensor, scaling_factor: float) -> torch.Tensor:
    """A draw from the cached latent distribution, scaled as the UNet expects (global RNG: resumable)."""
    return (mean + std * torch.randn_like(mean)) * scaling_factor


def min_snr_weights(scheduler, timesteps: torch.Tensor, gamma: float) -> torch.Tensor:
    """Per-sample loss weights of Min-SNR-gamma (Hang et al. 2023): min(SNR, gamma) / SNR for epsilon
    targets, min(SNR, gamma) / (SNR + 1) for v-prediction."""
    from diffusers.training_utils import compute_snr

    snr = compute_snr(scheduler, timesteps)
    clipped = torch.minimum(snr, torch.full_like(snr, gamma))
    if scheduler.config.prediction_type == "v_prediction":
        return clipped / (snr + 1)
    return clipped / snr


def diffusion_loss(
    unet,
    scheduler,
    batch: dict[str, torch.Tensor],
    *,
    scaling_factor: float,
    noise_offset: float = 0.0,
    snr_gamma: float | None = None,
    prior_loss_weight: float = 1.0,
    model_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Mean squared error between the UNet's prediction and the scheduler's target.

    Prior preservation: the instance samples' mean loss plus `prior_loss_weight` times the class
    samples' mean loss, as in diffusers' DreamBooth (there each batch is half instance, half class;
    here the halves are whatever the shuffled batch holds, and an absent half adds nothing).
    """
    latents = sample_latents(batch["latent_mean"], batch["latent_std"], scaling_factor)
    noise = torch.randn_like(latents)
    if noise_offset:
        # Offset noise (Guttenberg 2023): a per-channel constant shift lets the model change overall brightness.
        noise = noise + noise_offset * torch.randn(
            latents.shape[0], latents.shape[1], 1, 1, device=latents.device
        )
    bsz = latents.shape[0]
    timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (bsz,), device=latents.device).long()
    noisy = scheduler.add_noise(latents, noise, timesteps)
    if scheduler.config.prediction_type == "epsilon":
        target = noise
    else:
        target = scheduler.get_velocity(latents, noise, timesteps)
    added = None
    if "pooled_prompt_embeds" in batch:
        added = {
            "text_embeds": batch["pooled_prompt_embeds"].to(model_dtype),
            "time_ids": batch["time_ids"].to(model_dtype),
        }
    # Inputs in the frozen weights' dtype (a no-op under autocast, required without it).
    encoder_states = batch["prompt_embeds"].to(model_dtype)
    pred = unet(noisy.to(model_dtype), timesteps, encoder_states, added_cond_kwargs=added, return_dict=False)[
        0
    ]
    per_sample = F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))
    if snr_gamma is not None:
        per_sample = per_sample * min_snr_weights(scheduler, timesteps, snr_gamma)
    prior = batch["is_prior"]
    if not prior.any():
        return per_sample.mean()
    loss = per_sample.new_zeros(())
    if (~prior).any():
        loss = loss + per_sample[~prior].mean()
    return loss + prior_loss_weight * per_sample[prior].mean()
