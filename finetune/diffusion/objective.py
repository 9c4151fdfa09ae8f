"""The denoising loss of one batch: noise, timesteps, target, min-SNR weights, prior-preservation weight.

Objectives chosen by the pipeline's family (its `loss` in finetune.diffusion.families):
`diffusion_loss` (UNets: epsilon or v-prediction), `flow_matching_loss` (SD3: rectified flow),
`flux_loss` (Flux: rectified flow on 2x2-packed latents, with embedded guidance), `qwenimage_loss`
(Qwen-Image: 2x2-packed latents, a text mask) and `flux2_loss` (Flux.2: 2x2-patchified latents with
4-axis position ids). Uses the scheduler's own `add_noise` / `get_velocity` / `sigmas`, the pipelines'
own latent packing and position ids, and diffusers' `compute_snr`,
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
    mean: torch.Tensor,
    std: torch.Tensor,
    scaling_factor: float | list[float],
    shift_factor: float | list[float] = 0.0,
) -> torch.Tensor:
    """A draw from the cached latent distribution, shifted and scaled as the denoiser expects:
    `(z - shift_factor) * scaling_factor`, as the pipelines decode it back (global RNG: resumable).

    The factors are numbers, or one per latent channel (Qwen-Image's latents_mean / latents_std,
    Flux.2's BatchNorm statistics)."""
    z = mean + std * torch.randn_like(mean)
    return (z - _per_channel(shift_factor, z)) * _per_channel(scaling_factor, z)


def _per_channel(factor: float | list[float], like: torch.Tensor) -> float | torch.Tensor:
    if isinstance(factor, (int, float)):
        return factor
    return torch.as_tensor(factor, dtype=like.dtype, device=like.device).view(1, -1, *([1] * (like.ndim - 2)))


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
    text = {"encoder_hidden_states": batch["prompt_embeds"].to(model_dtype)}
    if "pooled_prompt_embeds" in batch:  # SD3, Flux
        text["pooled_projections"] = batch["pooled_prompt_embeds"].to(model_dtype)
    if "prompt_embeds_mask" in batch:  # Qwen-Image, a batch of captions of several lengths
        text["encoder_hidden_states_mask"] = batch["prompt_embeds_mask"]
    pred = transformer(
        hidden_states=noisy.to(model_dtype),
        timestep=timesteps.to(latents.device),
        return_dict=False,
        **text,
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


def qwenimage_loss(transformer, scheduler, batch: dict[str, torch.Tensor], **flow: Any) -> torch.Tensor:
    """Rectified-flow loss of Qwen-Image, as diffusers' train_dreambooth_lora_qwen_image.py computes it.

    `flow_matching_loss` (latents normalised per channel by the VAE's latents_mean / latents_std: the
    manifest's factors), the transformer seeing the noisy latents packed into 2x2 patches
    (`QwenImagePipeline._pack_latents`) with their `img_shapes`, `timestep / 1000` and the captions'
    mask when their lengths differ; its prediction is unpacked before the loss.
    """
    return flow_matching_loss(functools.partial(_qwenimage_forward, transformer), scheduler, batch, **flow)


def _qwenimage_forward(
    transformer, *, hidden_states: torch.Tensor, timestep: torch.Tensor, **inputs: Any
) -> tuple[torch.Tensor]:
    from diffusers import QwenImagePipeline

    bsz, channels, height, width = hidden_states.shape
    if height % 2 or width % 2:
        raise ValueError(f"Qwen-Image packs 2x2 latent patches: latent sides {height}x{width} must be even")
    pred = transformer(
        hidden_states=QwenImagePipeline._pack_latents(hidden_states, bsz, channels, height, width),
        timestep=timestep / 1000,
        img_shapes=[(1, height // 2, width // 2)] * bsz,
        **inputs,
    )[0]
    # vae_scale_factor 1: height and width are already latent sides; the frame axis (1) is dropped.
    return (QwenImagePipeline._unpack_latents(pred, height, width, 1).squeeze(2),)


def flux2_loss(
    transformer,
    scheduler,
    batch: dict[str, torch.Tensor],
    *,
    guidance_scale: float | None = None,
    **flow: Any,
) -> torch.Tensor:
    """Rectified-flow loss of Flux.2, as diffusers' train_dreambooth_lora_flux2_klein.py computes it.

    The cached latent distribution is patchified into 2x2 patches first (`_patchify_latents`: 4x the
    channels at half the side), where the manifest's per-channel factors (the VAE's BatchNorm
    statistics) apply; then `flow_matching_loss`, the transformer seeing the patchified latents as a
    sequence (`_pack_latents`) with their 4-axis position ids and the text's, `timestep / 1000` and
    `guidance_scale` when it is guidance-distilled. The target stays in the patchified space, as there.
    """
    from diffusers import Flux2KleinPipeline

    height, width = batch["latent_mean"].shape[-2:]
    if height % 2 or width % 2:
        raise ValueError(f"Flux.2 patchifies 2x2 latent patches: latent sides {height}x{width} must be even")
    patchified = {
        key: Flux2KleinPipeline._patchify_latents(batch[key]) for key in ("latent_mean", "latent_std")
    }
    return flow_matching_loss(
        functools.partial(_flux2_forward, transformer, guidance_scale),
        scheduler,
        {**batch, **patchified},
        **flow,
    )


def _flux2_forward(
    transformer,
    guidance_scale: float | None,
    *,
    hidden_states: torch.Tensor,
    timestep: torch.Tensor,
    **inputs: Any,
) -> tuple[torch.Tensor]:
    from diffusers import Flux2KleinPipeline

    bsz = hidden_states.shape[0]
    device = hidden_states.device
    guidance = None
    if guidance_scale is not None:
        guidance = torch.full((bsz,), float(guidance_scale), device=device, dtype=torch.float32)
    image_ids = Flux2KleinPipeline._prepare_latent_ids(hidden_states).to(device)
    packed = Flux2KleinPipeline._pack_latents(hidden_states)
    pred = transformer(
        hidden_states=packed,
        timestep=timestep / 1000,
        guidance=guidance,
        txt_ids=Flux2KleinPipeline._prepare_text_ids(inputs["encoder_hidden_states"]).to(device),
        img_ids=image_ids,
        **inputs,
    )[0]
    pred = pred[:, : packed.size(1)]
    return (Flux2KleinPipeline._unpack_latents_with_ids(pred, image_ids),)


def combine_prior(per_sample: torch.Tensor, prior: torch.Tensor, prior_loss_weight: float) -> torch.Tensor:
    """The batch loss: the instance samples' mean plus `prior_loss_weight` x the class samples' mean."""
    if not prior.any():
        return per_sample.mean()
    loss = per_sample.new_zeros(())
    if (~prior).any():
        loss = loss + per_sample[~prior].mean()
    return loss + prior_loss_weight * per_sample[prior].mean()
