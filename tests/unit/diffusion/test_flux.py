"""Flux: pipeline facts, the packed flow-matching loss with guidance, LoRA targets and files, cached
embeddings, recipe checks."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from diffusers import FlowMatchEulerDiscreteScheduler

from finetune.data.cache import compute_fingerprint
from finetune.diffusion.cache import fingerprint_inputs, prepare_images
from finetune.diffusion.model import (
    add_lora,
    check_settings,
    guidance_embeds,
    load_denoiser,
    load_lora_into_unet,
    load_noise_scheduler,
    load_vae,
    max_pixel_side,
    pipeline_info,
    pixel_multiple,
    save_lora,
)
from finetune.diffusion.objective import flux_loss
from finetune.errors import RecipeError
from finetune.recipe import load_recipe
from finetune.recipe.diffusion import DIFFUSION_DEFAULT_LORA_TARGETS
from tests.diffusion_data import COLORS, color_of, validated_recipe, write_color_folder

ATTENTION = {"to_k", "to_q", "to_v", "to_out.0", "add_k_proj", "add_q_proj", "add_v_proj", "to_add_out"}


# ------------------------------------------------------------------------------------- pipeline


def test_flux_pipeline_facts(tiny_flux: Path) -> None:
    info = pipeline_info(str(tiny_flux))
    assert (info.family, info.denoiser_name, info.flow_matching) == ("flux", "transformer", True)
    assert info.text_encoder_names == ("text_encoder", "text_encoder_2")
    assert info.tokenizer_names == ("tokenizer", "tokenizer_2")
    assert pixel_multiple(info) == 4  # VAE /2 x the 2x2 packing (the real VAE: 8 x 2 = 16)
    assert max_pixel_side(info) is None  # rotary position embeddings: no fixed grid
    assert guidance_embeds(info)
    assert (info.sequence_length(None), info.sequence_length(77)) == (512, 77)
    scheduler = load_noise_scheduler(info, None)
    assert isinstance(scheduler, FlowMatchEulerDiscreteScheduler) and scheduler.config.use_dynamic_shifting
    # Dynamic shifting happens at inference (from the image size): the training schedule is unshifted.
    torch.testing.assert_close(scheduler.sigmas[:1000], torch.linspace(1.0, 0.001, 1000))


# ------------------------------------------------------------------------------------- objective


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


def _batch(prior: list[bool], h: int = 4, w: int = 6) -> dict:
    g = torch.Generator().manual_seed(0)
    n = len(prior)
    return {
        "latent_mean": torch.randn(n, 16, h, w, generator=g),
        "latent_std": torch.rand(n, 16, h, w, generator=g) * 0.1,
        "prompt_embeds": torch.randn(n, 7, 8, generator=g),
        "pooled_prompt_embeds": torch.randn(n, 6, generator=g),
        "is_prior": torch.tensor(prior),
    }


def _by_hand(batch, scheme, *, scaling, shift_factor, prior_weight, logit_mean=0.0, logit_std=1.0):
    """The same draws in the same order; sigmas of the unshifted schedule from its formula."""
    torch.manual_seed(11)
    mean, std = batch["latent_mean"], batch["latent_std"]
    latents = (mean + std * torch.randn_like(mean) - shift_factor) * scaling
    noise = torch.randn_like(latents)
    n, steps = latents.shape[0], 1000
    if scheme == "logit_normal":
        u = torch.sigmoid(torch.normal(mean=logit_mean, std=logit_std, size=(n,)))
    else:
        u = torch.rand(n)
    index = (u * steps).long().clamp(max=steps - 1)
    sigma = ((steps - index).double() / steps).view(-1, 1, 1, 1)  # no shift: dynamic shifting
    noisy = (1 - sigma) * latents.double() + sigma * noise.double()
    target = noise.double() - latents.double()
    h, w = latents.shape[2:]
    packed = _pack(noisy)
    pred = _unpack(2 * packed + _ramp(packed.shape).double(), h, w)
    weight = {"sigma_sqrt": sigma**-2, "cosmap": 2 / (math.pi * (1 - 2 * sigma + 2 * sigma**2))}.get(
        scheme, 1.0
    )
    per = (weight * (pred - target) ** 2).mean(dim=(1, 2, 3))
    prior = batch["is_prior"]
    loss = per.mean() if not prior.any() else per[~prior].mean() + prior_weight * per[prior].mean()
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
    batch = _batch(prior)
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
    expected, packed, sigmas = _by_hand(
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
        flux_loss(RecordingFluxTransformer(), scheduler, _batch([False], h=5), scaling_factor=1.0)


def test_flux_loss_trains_the_real_transformer_with_checkpointing(tiny_flux: Path) -> None:
    """The cached layout (T5 tokens, pooled CLIP) fits the Flux transformer with guidance, and
    gradients reach every LoRA weight through gradient checkpointing."""
    info = pipeline_info(str(tiny_flux))
    transformer = load_denoiser(info, torch.float32)
    add_lora(
        transformer,
        rank=4,
        alpha=4,
        dropout=0.0,
        targets=DIFFUSION_DEFAULT_LORA_TARGETS,
        gradient_checkpointing=True,
    )
    transformer.train()
    g = torch.Generator().manual_seed(0)
    batch = {
        "latent_mean": torch.randn(2, 16, 8, 12, generator=g),
        "latent_std": torch.rand(2, 16, 8, 12, generator=g) * 0.1,
        "prompt_embeds": torch.randn(2, 20, 32, generator=g),
        "pooled_prompt_embeds": torch.randn(2, 32, generator=g),
        "is_prior": torch.tensor([False, True]),
    }
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


# ------------------------------------------------------------------------------------------ LoRA


def _adapted(model: torch.nn.Module) -> set[str]:
    return {name for name, module in model.named_modules() if hasattr(module, "lora_A")}


def test_default_lora_targets_cover_the_flux_attention(tiny_flux: Path) -> None:
    transformer = load_denoiser(pipeline_info(str(tiny_flux)), torch.float32)
    add_lora(
        transformer,
        rank=4,
        alpha=4,
        dropout=0.0,
        targets=DIFFUSION_DEFAULT_LORA_TARGETS,
        gradient_checkpointing=False,
    )
    adapted = _adapted(transformer)
    double = {f"transformer_blocks.0.attn.{name}" for name in ATTENTION}
    single = {f"single_transformer_blocks.0.attn.{name}" for name in ("to_q", "to_k", "to_v")}
    assert adapted == double | single  # not the feed-forward, modulation or embedding layers


def test_flux_lora_file_round_trip(tmp_path: Path, tiny_flux: Path) -> None:
    info = pipeline_info(str(tiny_flux))
    models = [load_denoiser(info, torch.float32) for _ in range(2)]
    for model in models:
        add_lora(
            model,
            rank=4,
            alpha=8,
            dropout=0.0,
            targets=["to_q", "add_q_proj", "ff.net.2"],
            gradient_checkpointing=False,
        )
    torch.manual_seed(3)
    with torch.no_grad():
        for p in models[0].parameters():
            if p.requires_grad:
                p.copy_(torch.randn_like(p))
    save_lora(info, models[0], tmp_path)
    from safetensors.torch import load_file

    keys = list(load_file(str(tmp_path / "pytorch_lora_weights.safetensors")))
    assert keys and all(k.startswith("transformer.") and ".lora_" in k for k in keys)
    assert any(k.startswith("transformer.single_transformer_blocks.0.attn.to_q.") for k in keys)
    load_lora_into_unet(models[1], tmp_path, prefix="transformer")
    loaded = dict(models[1].named_parameters())
    for name, value in models[0].named_parameters():
        if value.requires_grad:
            torch.testing.assert_close(loaded[name], value)


# ----------------------------------------------------------------------------------------- cache


def test_cached_flux_embeddings_are_the_pipelines_and_pair_with_their_images(
    tmp_path: Path, tiny_flux: Path
) -> None:
    from diffusers import FluxPipeline

    folder = tmp_path / "imgs"
    write_color_folder(folder, captions="jsonl", count=4)
    recipe = validated_recipe(tmp_path, tiny_flux, folder, max_sequence_length=20, aspect_ratio_buckets=False)
    prepared = prepare_images(recipe, log=lambda _: None)
    manifest = prepared.manifest
    assert (manifest["latents"]["scaling_factor"], manifest["latents"]["shift_factor"]) == (0.3611, 0.1159)
    assert manifest["fingerprint_inputs"]["text"] == {"max_sequence_length": 20}
    assert [p["subfolder"] for p in manifest["fingerprint_inputs"]["text_encoders"]] == [
        "text_encoder",
        "text_encoder_2",
        "tokenizer",
        "tokenizer_2",
    ]
    pipe = FluxPipeline.from_pretrained(tiny_flux)
    vae = load_vae(pipeline_info(str(tiny_flux)))
    assert len(prepared.train) == 4
    for row in prepared.train.with_format("numpy"):
        assert list(row["prompt_shape"]) == [20, 32]  # T5 tokens x T5 width
        with torch.no_grad():
            embeds, pooled, _ = pipe.encode_prompt(row["caption"], None, max_sequence_length=20)
        np.testing.assert_allclose(row["prompt_embeds"].reshape(20, 32), embeds[0].numpy(), atol=1e-5)
        np.testing.assert_allclose(row["pooled_prompt_embeds"], pooled[0].numpy(), atol=1e-5)
        # The raw VAE mean of this caption's solid-colour image (not shifted, not scaled).
        shape = tuple(int(x) for x in row["latent_shape"])
        rgb = torch.tensor(COLORS[color_of(str(row["caption"]))], dtype=torch.float32) / 127.5 - 1
        with torch.no_grad():
            mean = vae.encode(rgb.view(1, 3, 1, 1).expand(1, 3, 32, 32)).latent_dist.mean[0]
        assert shape == tuple(mean.shape) == (16, 16, 16)
        np.testing.assert_allclose(row["latent_mean"].reshape(shape), mean.numpy(), atol=2e-4)


def test_max_sequence_length_is_in_the_flux_fingerprint(tmp_path: Path, tiny_flux: Path) -> None:
    folder = tmp_path / "imgs"
    write_color_folder(folder, count=2)

    def inputs(**diffusion) -> dict:
        return fingerprint_inputs(
            validated_recipe(tmp_path, tiny_flux, folder, **diffusion), pipeline_info(str(tiny_flux))
        )

    default, explicit, short = inputs(), inputs(max_sequence_length=512), inputs(max_sequence_length=64)
    assert default["text"] == {"max_sequence_length": 512}  # null resolves to FluxPipeline's default
    assert compute_fingerprint(default) == compute_fingerprint(explicit) != compute_fingerprint(short)


def test_sides_that_do_not_pack_are_refused(tmp_path: Path, tiny_flux: Path) -> None:
    folder = tmp_path / "imgs"
    write_color_folder(folder, count=2)
    recipe = validated_recipe(tmp_path, tiny_flux, folder, resolution=30)
    with pytest.raises(RecipeError, match=r"diffusion.resolution: 30 is not a multiple of 4 .* use e.g. 32"):
        prepare_images(recipe, log=lambda _: None)


# ---------------------------------------------------------------------------------------- recipe


def _without_guidance_embeds(tmp_path: Path, tiny_flux: Path) -> Path:
    """The tiny pipeline with a schnell-like transformer config (no guidance embedding)."""
    folder = tmp_path / "schnell-like"
    shutil.copytree(tiny_flux, folder)
    config_path = folder / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config["guidance_embeds"] = False
    config_path.write_text(json.dumps(config))
    return folder


def test_guidance_scale_is_refused_where_nothing_reads_it(
    tmp_path: Path, tiny_flux: Path, tiny_sd3: Path
) -> None:
    folder = tmp_path / "imgs"
    write_color_folder(folder, count=2)
    check_settings(
        pipeline_info(str(tiny_flux)),
        validated_recipe(tmp_path, tiny_flux, folder, guidance_scale=1.0).diffusion,
    )
    with pytest.raises(
        RecipeError, match=r"diffusion.guidance_scale: the embedded guidance of guidance-distilled"
    ):
        check_settings(
            pipeline_info(str(tiny_sd3)),
            validated_recipe(tmp_path, tiny_sd3, folder, guidance_scale=1.0).diffusion,
        )
    schnell = _without_guidance_embeds(tmp_path, tiny_flux)
    info = pipeline_info(str(schnell))
    assert not guidance_embeds(info)
    # The default guidance_scale: not used, no error.
    check_settings(info, validated_recipe(tmp_path, schnell, folder).diffusion)
    bad = validated_recipe(tmp_path, schnell, folder, guidance_scale=4.0)
    with pytest.raises(RecipeError, match=r"diffusion.guidance_scale: .* has no guidance embedding"):
        prepare_images(bad, log=lambda _: None)  # before anything is encoded
    assert not (tmp_path / "prepared").exists()


def test_recipe_rejects_guidance_scale_for_epsilon_models(tmp_path: Path) -> None:
    data = {
        "model": {"kind": "diffusion", "model_path": "black-forest-labs/FLUX.1-dev"},
        "data": {"datasets": [{"path": "photos", "type": "images"}]},
        "train": {"output_dir": "out"},
        "diffusion": {"prediction_type": "epsilon", "guidance_scale": 1.0},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    text = str(info.value)
    assert "diffusion.guidance_scale" in text and "flow matching (SD3, Flux) only" in text
