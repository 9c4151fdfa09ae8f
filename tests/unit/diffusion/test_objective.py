"""The denoising losses (finetune.diffusion.objective): targets per prediction type, min-SNR weights,
offset noise, prior weighting (SD, SDXL); flow matching with its timestep densities and weightings
(SD3) and with packed latents and embedded guidance (Flux), against hand computations and on the real
tiny transformers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler

from finetune.diffusion.model import load_denoiser, load_noise_scheduler, pipeline_info
from finetune.diffusion.objective import (
    diffusion_loss,
    flow_matching_loss,
    flow_sigmas,
    flux_loss,
    min_snr_weights,
)
from tests.diffusion_data import with_default_lora


class RecordingUNet(torch.nn.Module):
    """Predicts zeros and records its inputs: the loss is then mean(target^2) per sample."""

    def forward(self, noisy, timesteps, states, added_cond_kwargs=None, return_dict=False):
        self.seen = (noisy, timesteps, states, added_cond_kwargs)
        return (torch.zeros_like(noisy),)


def _batch(
    prior: list[bool],
    *,
    channels: int = 4,
    h: int = 4,
    w: int = 4,
    tokens: int = 3,
    width: int = 8,
    pooled: int | None = None,
) -> dict:
    """Cached rows of random latents (`channels` x h x w) and prompt embeddings (`tokens` x `width`,
    plus pooled ones of width `pooled` if given), one per entry of `prior` (is it a class image)."""
    g = torch.Generator().manual_seed(0)
    n = len(prior)
    batch = {
        "latent_mean": torch.randn(n, channels, h, w, generator=g),
        "latent_std": torch.rand(n, channels, h, w, generator=g) * 0.1,
        "prompt_embeds": torch.randn(n, tokens, width, generator=g),
    }
    if pooled is not None:
        batch["pooled_prompt_embeds"] = torch.randn(n, pooled, generator=g)
    return batch | {"is_prior": torch.tensor(prior)}


# The cached layouts of the flow-matching tests (16 latent channels, pooled text embeddings).
SD3_BATCH = {"channels": 16, "tokens": 5, "pooled": 6}
FLUX_BATCH = {"channels": 16, "w": 6, "tokens": 7, "pooled": 6}


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


# --------------------------------------------------------------------------- flow matching (SD3)


class RecordingTransformer(torch.nn.Module):
    """Predicts zeros and records its inputs: the loss is then mean(weight * target^2) per sample."""

    def forward(self, hidden_states, timestep, encoder_hidden_states, pooled_projections, return_dict=False):
        self.seen = {
            "noisy": hidden_states,
            "timestep": timestep,
            "prompt": encoder_hidden_states,
            "pooled": pooled_projections,
        }
        return (torch.zeros_like(hidden_states),)


def _flow_draws(batch, scheme, *, scaling, shift_factor, logit_mean=0.0, logit_std=1.0, mode_scale=1.29):
    """The flow-matching losses' draws in their order (latents from the cached distribution, noise,
    the schedule index from the timestep density of `scheme`), as the unshifted t per sample."""
    torch.manual_seed(11)
    mean, std = batch["latent_mean"], batch["latent_std"]
    latents = (mean + std * torch.randn_like(mean) - shift_factor) * scaling
    noise = torch.randn_like(latents)
    n, steps = latents.shape[0], 1000
    if scheme == "logit_normal":
        u = torch.sigmoid(torch.normal(mean=logit_mean, std=logit_std, size=(n,)))
    elif scheme == "mode":
        u = torch.rand(n)
        u = 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    else:
        u = torch.rand(n)
    index = (u * steps).long().clamp(max=steps - 1)
    t = (steps - index).double() / steps  # the schedule runs from t = 1 down to 1/steps
    return latents, noise, t.view(-1, 1, 1, 1)


def _weighted_mean(squared_error, sigma, scheme, prior, prior_weight):
    """The loss from the per-element squared error: weighted by `scheme`, a mean per sample, then over
    the instance samples plus `prior_weight` x the mean over the class samples."""
    weight = {"sigma_sqrt": sigma**-2, "cosmap": 2 / (math.pi * (1 - 2 * sigma + 2 * sigma**2))}.get(
        scheme, 1.0
    )
    per = (weight * squared_error).mean(dim=(1, 2, 3))
    return per.mean() if not prior.any() else per[~prior].mean() + prior_weight * per[prior].mean()


def _flow_matching_by_hand(
    batch, scheme, *, scaling, shift_factor, shift, prior_weight, logit_mean, logit_std, mode_scale
):
    """The same draws in the same order; sigmas from the shifted schedule's formula, not the scheduler."""
    latents, noise, t = _flow_draws(
        batch, scheme, scaling=scaling, shift_factor=shift_factor, logit_mean=logit_mean,
        logit_std=logit_std, mode_scale=mode_scale,
    )  # fmt: skip
    sigma = shift * t / (1 + (shift - 1) * t)
    noisy = (1 - sigma) * latents.double() + sigma * noise.double()
    target = noise.double() - latents.double()
    loss = _weighted_mean(target**2, sigma, scheme, batch["is_prior"], prior_weight)
    return loss, noisy, sigma.flatten() * 1000


@pytest.mark.parametrize(
    ("scheme", "prior", "params"),
    [
        ("none", [False] * 3, {}),
        ("logit_normal", [False] * 3, {}),
        ("logit_normal", [False, True, True], {"logit_mean": 0.5, "logit_std": 2.0}),
        ("mode", [False] * 4, {"mode_scale": 0.8}),
        ("sigma_sqrt", [True, False, False], {}),
        ("cosmap", [False] * 3, {}),
    ],
)
def test_flow_matching_loss_matches_a_hand_computation(scheme: str, prior: list[bool], params: dict) -> None:
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    batch = _batch(prior, **SD3_BATCH)
    settings = {"logit_mean": 0.0, "logit_std": 1.0, "mode_scale": 1.29} | params
    model = RecordingTransformer()
    torch.manual_seed(11)
    loss = flow_matching_loss(
        model,
        scheduler,
        batch,
        scaling_factor=1.5305,
        shift_factor=0.0609,
        weighting_scheme=scheme,
        prior_loss_weight=0.7,
        **settings,
    )
    expected, noisy, timesteps = _flow_matching_by_hand(
        batch, scheme, scaling=1.5305, shift_factor=0.0609, shift=3.0, prior_weight=0.7, **settings
    )
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    torch.testing.assert_close(model.seen["noisy"].double(), noisy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.seen["timestep"].double(), timesteps, rtol=1e-5, atol=1e-3)
    assert model.seen["pooled"] is not None and model.seen["pooled"].shape == (len(prior), 6)


def test_flow_sigmas_clamp_the_end_of_the_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mode density maps u = 0 to exactly 1: that is the schedule's last entry, not one past it."""
    import diffusers.training_utils

    monkeypatch.setattr(
        diffusers.training_utils,
        "compute_density_for_timestep_sampling",
        lambda **_: torch.tensor([1.0, 0.0, 0.5]),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    timesteps, sigmas = flow_sigmas(scheduler, 3, weighting_scheme="mode")
    torch.testing.assert_close(sigmas, scheduler.sigmas[[999, 0, 500]])
    torch.testing.assert_close(timesteps, scheduler.timesteps[[999, 0, 500]])
    scheduler.set_timesteps(4)
    with pytest.raises(ValueError, match="holds 4 timesteps, not 1000"):
        flow_sigmas(scheduler, 3, weighting_scheme="mode")


def test_flow_matching_loss_trains_the_real_transformer_with_checkpointing(tiny_sd3: Path) -> None:
    """The cached layout (CLIP + T5 tokens, pooled CLIP projections) fits the SD3 transformer, and
    gradients reach the LoRA weights through gradient checkpointing."""
    info = pipeline_info(str(tiny_sd3))
    transformer = with_default_lora(load_denoiser(info, torch.float32), gradient_checkpointing=True)
    transformer.train()
    batch = _batch([False, True], channels=16, h=8, w=12, tokens=16 + 20, width=32, pooled=32)
    loss = flow_matching_loss(
        transformer, load_noise_scheduler(info, None), batch, scaling_factor=1.5305, shift_factor=0.0609
    )
    loss.backward()
    grads = {n: p.grad for n, p in transformer.named_parameters() if p.requires_grad}
    assert torch.isfinite(loss) and all(g is not None for g in grads.values())
    # The last block's text-stream output is discarded (context_pre_only): its text queries get no
    # gradient, as in diffusers (its default targets adapt them too). Every other LoRA B does.
    zero = {n for n, g in grads.items() if "lora_B" in n and g.abs().sum() == 0}
    assert zero == {"transformer_blocks.1.attn.add_q_proj.lora_B.default.weight"}


# ------------------------------------------------------------- flow matching, packed, guided (Flux)


def _pack(x: torch.Tensor) -> torch.Tensor:
    """2x2 patches, by index: token i * (w/2) + j holds x[c, 2i + di, 2j + dj] at c * 4 + di * 2 + dj."""
    b, c, h, w = x.shape
    out = torch.empty(b, (h // 2) * (w // 2), c * 4, dtype=x.dtype)
    for i in range(h // 2):
        for j in range(w // 2):
            for ch in range(c):
                for di in range(2):
                    for dj in range(2):
                        out[:, i * (w // 2) + j, ch * 4 + di * 2 + dj] = x[:, ch, 2 * i + di, 2 * j + dj]
    return out


def _unpack(packed: torch.Tensor, h: int, w: int) -> torch.Tensor:
    b, _, features = packed.shape
    out = torch.empty(b, features // 4, h, w, dtype=packed.dtype)
    for i in range(h // 2):
        for j in range(w // 2):
            for ch in range(features // 4):
                for di in range(2):
                    for dj in range(2):
                        out[:, ch, 2 * i + di, 2 * j + dj] = packed[:, i * (w // 2) + j, ch * 4 + di * 2 + dj]
    return out


class RecordingFluxTransformer(torch.nn.Module):
    """Records its inputs and predicts `2 x input + ramp`, a ramp that differs per token and feature,
    so a wrong unpacking changes the loss."""

    def forward(
        self,
        hidden_states,
        timestep,
        guidance,
        pooled_projections,
        encoder_hidden_states,
        txt_ids,
        img_ids,
        return_dict=False,
    ):
        self.seen = {
            "packed": hidden_states,
            "timestep": timestep,
            "guidance": guidance,
            "pooled": pooled_projections,
            "prompt": encoder_hidden_states,
            "txt_ids": txt_ids,
            "img_ids": img_ids,
        }
        return (2 * hidden_states + _ramp(hidden_states.shape),)


def _ramp(shape) -> torch.Tensor:
    _, tokens, features = shape
    return (
        torch.arange(tokens).view(1, -1, 1) * 0.01 + torch.arange(features).view(1, 1, -1) * 0.001
    ).expand(shape)


def _flux_by_hand(batch, scheme, *, scaling, shift_factor, prior_weight, logit_mean=0.0, logit_std=1.0):
    """The same draws in the same order; sigmas of the unshifted schedule from its formula."""
    latents, noise, sigma = _flow_draws(
        batch, scheme, scaling=scaling, shift_factor=shift_factor, logit_mean=logit_mean, logit_std=logit_std
    )  # no shift: dynamic shifting
    noisy = (1 - sigma) * latents.double() + sigma * noise.double()
    target = noise.double() - latents.double()
    h, w = latents.shape[2:]
    packed = _pack(noisy)
    pred = _unpack(2 * packed + _ramp(packed.shape).double(), h, w)
    loss = _weighted_mean((pred - target) ** 2, sigma, scheme, batch["is_prior"], prior_weight)
    return loss, packed, sigma.flatten()


@pytest.mark.parametrize(
    ("scheme", "prior", "guidance", "params"),
    [
        ("none", [False] * 3, 3.5, {}),
        ("logit_normal", [False, True, True], 3.5, {"logit_mean": 0.5, "logit_std": 2.0}),
        ("sigma_sqrt", [True, False], None, {}),
        ("cosmap", [False] * 2, 1.0, {}),
    ],
)
def test_flux_loss_matches_a_hand_computation(
    scheme: str, prior: list[bool], guidance: float | None, params: dict
) -> None:
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True
    )
    batch = _batch(prior, **FLUX_BATCH)
    model = RecordingFluxTransformer()
    torch.manual_seed(11)
    loss = flux_loss(
        model,
        scheduler,
        batch,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        guidance_scale=guidance,
        weighting_scheme=scheme,
        prior_loss_weight=0.7,
        **params,
    )
    expected, packed, sigmas = _flux_by_hand(
        batch, scheme, scaling=0.3611, shift_factor=0.1159, prior_weight=0.7, **params
    )
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    seen, n = model.seen, len(prior)
    assert seen["packed"].shape == (n, 2 * 3, 16 * 4)  # 4x6 latents -> 2x3 tokens of 2x2x16
    torch.testing.assert_close(seen["packed"].double(), packed, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(seen["timestep"].double(), sigmas, rtol=1e-5, atol=1e-6)  # timesteps / 1000
    if guidance is None:
        assert seen["guidance"] is None
    else:
        torch.testing.assert_close(seen["guidance"], torch.full((n,), guidance))
    expected_ids = torch.tensor([[0.0, i, j] for i in range(2) for j in range(3)])
    torch.testing.assert_close(seen["img_ids"], expected_ids)  # (0, row, column) of each token
    torch.testing.assert_close(seen["txt_ids"], torch.zeros(7, 3))
    assert seen["pooled"].shape == (n, 6) and seen["prompt"].shape == (n, 7, 8)


def test_odd_latent_sides_are_refused() -> None:
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, use_dynamic_shifting=True)
    with pytest.raises(ValueError, match=r"latent sides 5x6 must be even"):
        flux_loss(
            RecordingFluxTransformer(),
            scheduler,
            _batch([False], **FLUX_BATCH | {"h": 5}),
            scaling_factor=1.0,
        )


def test_flux_loss_trains_the_real_transformer_with_checkpointing(tiny_flux: Path) -> None:
    """The cached layout (T5 tokens, pooled CLIP) fits the Flux transformer with guidance, and
    gradients reach every LoRA weight through gradient checkpointing."""
    info = pipeline_info(str(tiny_flux))
    transformer = with_default_lora(load_denoiser(info, torch.float32), gradient_checkpointing=True)
    transformer.train()
    batch = _batch([False, True], channels=16, h=8, w=12, tokens=20, width=32, pooled=32)
    scheduler = load_noise_scheduler(info, None)
    loss = flux_loss(
        transformer, scheduler, batch, scaling_factor=0.3611, shift_factor=0.1159, guidance_scale=3.5
    )
    loss.backward()
    grads = {n: p.grad for n, p in transformer.named_parameters() if p.requires_grad}
    assert (
        torch.isfinite(loss)
        and grads
        and all(g is not None and torch.isfinite(g).all() for g in grads.values())
    )
    assert all(g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)
    # The guidance value reaches the prediction: another value gives another loss for the same draws.
    with torch.no_grad():
        losses = []
        for guidance in (1.0, 3.5):
            torch.manual_seed(5)
            losses.append(
                flux_loss(
                    transformer, scheduler, batch, scaling_factor=0.3611, guidance_scale=guidance
                ).item()
            )
    assert losses[0] != losses[1]
