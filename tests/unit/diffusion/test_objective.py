"""The denoising loss: targets per prediction type, min-SNR weights, offset noise, prior weighting."""

from __future__ import annotations

import pytest
import torch
from diffusers import DDPMScheduler

from finetune.diffusion.objective import diffusion_loss, min_snr_weights


class RecordingUNet(torch.nn.Module):
    """Predicts zeros and records its inputs: the loss is then mean(target^2) per sample."""

    def forward(self, noisy, timesteps, states, added_cond_kwargs=None, return_dict=False):
        self.seen = (noisy, timesteps, states, added_cond_kwargs)
        return (torch.zeros_like(noisy),)


def _batch(prior: list[bool]) -> dict:
    g = torch.Generator().manual_seed(0)
    n = len(prior)
    return {
        "latent_mean": torch.randn(n, 4, 4, 4, generator=g),
        "latent_std": torch.rand(n, 4, 4, 4, generator=g) * 0.1,
        "prompt_embeds": torch.randn(n, 3, 8, generator=g),
        "is_prior": torch.tensor(prior),
    }


def _expected(scheduler, batch, *, scaling, gamma=None, prior_weight=1.0, offset=0.0):
    """The same draws in the same order, computed by hand."""
    torch.manual_seed(11)
    mean, std = batch["latent_mean"], batch["latent_std"]
    latents = (mean + std * torch.randn_like(mean)) * scaling
    noise = torch.randn_like(latents)
    if offset:
        noise = noise + offset * torch.randn(latents.shape[0], latents.shape[1], 1, 1)
    t = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],)).long()
    if scheduler.config.prediction_type == "epsilon":
        target = noise
    else:
        alpha = scheduler.alphas_cumprod[t].sqrt().view(-1, 1, 1, 1)
        sigma = (1 - scheduler.alphas_cumprod[t]).sqrt().view(-1, 1, 1, 1)
        target = alpha * noise - sigma * latents
    per = (target**2).mean(dim=(1, 2, 3))
    if gamma is not None:
        snr = scheduler.alphas_cumprod[t] / (1 - scheduler.alphas_cumprod[t])
        weight = torch.minimum(snr, torch.full_like(snr, gamma))
        per = per * weight / (snr + 1 if scheduler.config.prediction_type == "v_prediction" else snr)
    prior = batch["is_prior"]
    if not prior.any():
        return per.mean()
    return per[~prior].mean() + prior_weight * per[prior].mean()


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
@pytest.mark.parametrize(
    ("gamma", "offset", "prior"), [(None, 0.0, [False] * 3), (5.0, 0.1, [False, True, True])]
)
def test_loss_matches_a_hand_computation(prediction_type, gamma, offset, prior) -> None:
    scheduler = DDPMScheduler(beta_schedule="scaled_linear", prediction_type=prediction_type)
    batch = _batch(prior)
    torch.manual_seed(11)
    unet = RecordingUNet()
    loss = diffusion_loss(
        unet,
        scheduler,
        batch,
        scaling_factor=0.18,
        noise_offset=offset,
        snr_gamma=gamma,
        prior_loss_weight=0.5,
    )
    expected = _expected(scheduler, batch, scaling=0.18, gamma=gamma, prior_weight=0.5, offset=offset)
    torch.testing.assert_close(loss, expected)
    assert unet.seen[3] is None  # SD: no added conditioning


def test_min_snr_weights_clip_at_gamma() -> None:
    scheduler = DDPMScheduler(beta_schedule="scaled_linear")
    t = torch.tensor([1, 500, 999])
    w = min_snr_weights(scheduler, t, 5.0)
    snr = scheduler.alphas_cumprod[t] / (1 - scheduler.alphas_cumprod[t])
    assert w[0] == pytest.approx(5.0 / snr[0].item(), rel=1e-4)  # high SNR: down-weighted
    assert w[2] == pytest.approx(1.0)  # low SNR: unchanged


def test_sdxl_conditioning_reaches_the_unet() -> None:
    scheduler = DDPMScheduler()
    batch = _batch([False, False]) | {"pooled_prompt_embeds": torch.ones(2, 8), "time_ids": torch.ones(2, 6)}
    unet = RecordingUNet()
    diffusion_loss(unet, scheduler, batch, scaling_factor=1.0)
    assert set(unet.seen[3]) == {"text_embeds", "time_ids"}
