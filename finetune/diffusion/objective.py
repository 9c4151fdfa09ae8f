"""The denoising loss of one batch: noise, timesteps, target, min-SNR weights, prior-preservation weight.

Objectives chosen by the pipeline's family: `diffusion_loss` (UNets: epsilon or v-prediction),
`flow_matching_loss` (SD3: rectified flow) and `flux_loss` (Flux: rectified flow on 2x2-packed
latents, with embedded guidance). Uses the scheduler's own `add_noise` / `get_velocity` / `sigmas`,
FluxPipeline's latent packing and position ids, and diffusers' `compute_snr`,
`compute_density_for_timestep_sampling` and `compute_loss_weighting_for_sd3`; what is written here
is only the glue those lack (sampling cached latent distributions, per-sample weighting, the
prior-preservation split).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F


def sample_latents(
    mean: torch.Tensor, std: torch.Tensor, scaling_factor: float, shift_factor: float = 0.0
) -> torch.Tensor:
    """A draw from the cached latent distribution, shifted and scaled as the denoiser expects:
    `(z - shift_factor) * scaling_factor`, as the pipelines decode it back (global RNG: resumable)."""
    return (mean + std * torch.randn_like(mean) - shift_factor) * scaling_factor


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
    return combine_prior(per_sample, batch["is_prior"], prior_loss_weight)


def flow_sigmas(
    scheduler,
    batch_size: int,
    *,
    weighting_scheme: str,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(timesteps, sigmas) of a batch, drawn as diffusers' SD3 scripts draw them (global CPU RNG).

    u ~ the scheme's density on [0, 1) picks an entry of the scheduler's training schedule
    (`timesteps` = `sigmas` x num_train_timesteps, already shifted by the scheduler's `shift`).
    """
    from diffusers.training_utils import compute_density_for_timestep_sampling

    u = compute_density_for_timestep_sampling(
        weighting_scheme=weighting_scheme,
        batch_size=batch_size,
        logit_mean=logit_mean,
        logit_std=logit_std,
        mode_scale=mode_scale,
    )
    count = scheduler.config.num_train_timesteps
    if len(scheduler.timesteps) != count:  # set_timesteps (sampling) replaces the training schedule
        raise ValueError(f"the training scheduler holds {len(scheduler.timesteps)} timesteps, not {count}")
    # The mode density maps u = 0 to exactly 1, one past the schedule's end: clamp to its last entry.
    indices = (u * count).long().clamp(0, count - 1)
    return scheduler.timesteps[indices], scheduler.sigmas[indices]


def flow_matching_loss(
    transformer,
    scheduler,
    batch: dict[str, torch.Tensor],
    *,
    scaling_factor: float,
    shift_factor: float = 0.0,
    weighting_scheme: str = "logit_normal",
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
    prior_loss_weight: float = 1.0,
    model_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rectified-flow loss of SD3: the transformer predicts the velocity `noise - latents` at
    `(1 - sigma) * latents + sigma * noise`, weighted per sample by `compute_loss_weighting_for_sd3`.

    As diffusers' train_dreambooth_lora_sd3.py with `--precondition_outputs 0` (its default 1 is
    this loss times sigma^2). Prior preservation as in `diffusion_loss`.
    """
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    # Latents, noise and noise levels, drawn in this order (resumable).
    latents = sample_latents(batch["latent_mean"], batch["latent_std"], scaling_factor, shift_factor)
    noise = torch.randn_like(latents)
    timesteps, sigmas = flow_sigmas(
        scheduler,
        latents.shape[0],
        weighting_scheme=weighting_scheme,
        logit_mean=logit_mean,
        logit_std=logit_std,
        mode_scale=mode_scale,
    )
    sigmas = sigmas.to(latents.device, torch.float32).view(-1, 1, 1, 1)
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    pred = transformer(
        hidden_states=noisy.to(model_dtype),
        timestep=timesteps.to(latents.device),
        encoder_hidden_states=batch["prompt_embeds"].to(model_dtype),
        pooled_projections=batch["pooled_prompt_embeds"].to(model_dtype),
        return_dict=False,
    )[0]
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=weighting_scheme, sigmas=sigmas).float()
    per_sample = (weighting * (pred.float() - (noise - latents).float()) ** 2).mean(dim=(1, 2, 3))
    return combine_prior(per_sample, batch["is_prior"], prior_loss_weight)


def flux_loss(
    transformer,
    scheduler,
    batch: dict[str, torch.Tensor],
    *,
    guidance_scale: float | None = None,
    **flow: Any,
) -> torch.Tensor:
    """Rectified-flow loss of Flux, as diffusers' train_dreambooth_lora_flux.py computes it.

    `flow_matching_loss` (the same draws, target and weighting; `flow` are its keyword arguments),
    but the transformer sees the noisy latents packed into 2x2 patches (`FluxPipeline._pack_latents`)
    with their position ids, zero text ids, `timestep / 1000`, and `guidance_scale` as its embedded
    guidance (None for transformers without guidance embeddings, e.g. FLUX.1-schnell); its prediction
    is unpacked before the loss. The schedule's sigmas are the scheduler's: Flux's shifts dynamically
    at inference only, so training draws unshifted sigmas, as that script does. Latent sides must be
    even (`pixel_multiple`).
    """
    return flow_matching_loss(
        functools.partial(_flux_forward, transformer, guidance_scale), scheduler, batch, **flow
    )


def _flux_forward(
    transformer,
    guidance_scale: float | None,
    *,
    hidden_states: torch.Tensor,
    timestep: torch.Tensor,
    **inputs: Any,
) -> tuple[torch.Tensor]:
    """The Flux transformer called as `flow_matching_loss` calls SD3's: on unpacked latents in the model
    dtype; the text inputs (`inputs`) go through as they are."""
    from diffusers import FluxPipeline

    bsz, channels, height, width = hidden_states.shape
    if height % 2 or width % 2:
        raise ValueError(f"Flux packs 2x2 latent patches: latent sides {height}x{width} must be even")
    device, dtype = hidden_states.device, hidden_states.dtype
    guidance = None
    if guidance_scale is not None:
        guidance = torch.full((bsz,), float(guidance_scale), device=device, dtype=torch.float32)
    pred = transformer(
        hidden_states=FluxPipeline._pack_latents(hidden_states, bsz, channels, height, width),
        timestep=timestep / 1000,
        guidance=guidance,
        txt_ids=torch.zeros(inputs["encoder_hidden_states"].shape[1], 3, device=device, dtype=dtype),
        img_ids=FluxPipeline._prepare_latent_image_ids(bsz, height // 2, width // 2, device, dtype),
        **inputs,
    )[0]
    # vae_scale_factor 1: height and width are already latent sides.
    return (FluxPipeline._unpack_latents(pred, height, width, 1),)


def combine_prior(per_sample: torch.Tensor, prior: torch.Tensor, prior_loss_weight: float) -> torch.Tensor:
    """The batch loss: the instance samples' mean plus `prior_loss_weight` x the class samples' mean."""
    if not prior.any():
        return per_sample.mean()
    loss = per_sample.new_zeros(())
    if (~prior).any():
        loss = loss + per_sample[~prior].mean()
    return loss + prior_loss_weight * per_sample[prior].mean()
