"""Qwen-Image and Flux.2 [klein] against diffusers' own code, on their tiny pipelines: the family table's
facts, the cached text embeddings and latents (the pipelines' encode_prompt and VAE), the latent
normalisation (inverted by the pipelines' own decoding formula), the collated text mask, and the losses
computed step by step as diffusers' train_dreambooth_lora_{qwen_image,flux2_klein}.py compute them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from finetune.diffusion.cache import prepare_images
from finetune.diffusion.loader import collate
from finetune.diffusion.model import (
    load_denoiser,
    load_noise_scheduler,
    load_vae,
    max_pixel_side,
    pipeline_info,
    pixel_multiple,
)
from finetune.diffusion.objective import flow_sigmas, flux2_loss, qwenimage_loss, sample_latents
from tests.diffusion_data import COLORS, color_of, validated_recipe, with_default_lora, write_color_folder

PIPELINES = {"qwenimage": "QwenImagePipeline", "flux2": "Flux2KleinPipeline"}


@pytest.fixture(scope="module")
def tiny_qwenimage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from finetune.diffusion.tiny import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("pipelines") / "tiny-qwenimage", qwenimage=True)


@pytest.fixture(scope="module")
def tiny_flux2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from finetune.diffusion.tiny import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("pipelines") / "tiny-flux2", flux2=True)


@pytest.mark.parametrize("family", ["qwenimage", "flux2"])
def test_the_table_knows_the_new_families(family: str, request: pytest.FixtureRequest) -> None:
    import diffusers

    folder = request.getfixturevalue(f"tiny_{family}")
    info = pipeline_info(str(folder))
    assert (info.family, info.class_name, info.denoiser_name) == (family, PIPELINES[family], "transformer")
    assert info.flow_matching and info.text_encoder_names == ("text_encoder",)
    assert info.sequence_length(None) == 512 and info.sequence_length(24) == 24
    # The pipeline's own image processor rounds sides to this multiple: VAE factor (2) x 2x2 packing.
    pipe = getattr(diffusers, PIPELINES[family]).from_pretrained(folder)
    assert pixel_multiple(info) == pipe.image_processor.config.vae_scale_factor == 4
    assert max_pixel_side(info) is None
    assert type(load_denoiser(info, torch.float32)).__name__ == info.spec.denoiser_class


@pytest.mark.parametrize("family", ["qwenimage", "flux2"])
def test_cached_embeddings_and_latents_are_the_pipelines(
    tmp_path: Path, family: str, request: pytest.FixtureRequest
) -> None:
    import diffusers

    folder = request.getfixturevalue(f"tiny_{family}")
    images = tmp_path / "imgs"
    write_color_folder(images, captions="jsonl", count=4)
    length = 64 if family == "qwenimage" else 20  # Qwen-Image: room for captions of several lengths
    recipe = validated_recipe(
        tmp_path, folder, images, max_sequence_length=length, aspect_ratio_buckets=False
    )
    prepared = prepare_images(recipe, log=lambda _: None)
    pipe = getattr(diffusers, PIPELINES[family]).from_pretrained(folder)
    vae = load_vae(pipeline_info(str(folder)))
    lengths = set()
    for row in prepared.train.with_format("numpy"):
        shape = tuple(int(x) for x in row["prompt_shape"])
        lengths.add(shape[0])
        with torch.no_grad():  # the caption alone, as inference encodes it
            embeds = pipe.encode_prompt(prompt=str(row["caption"]), max_sequence_length=length)[0][0]
        assert shape == tuple(embeds.shape)
        np.testing.assert_allclose(row["prompt_embeds"].reshape(shape), embeds.numpy(), atol=1e-5)
        rgb = torch.tensor(COLORS[color_of(str(row["caption"]))], dtype=torch.float32) / 127.5 - 1
        pixels = rgb.view(1, 3, 1, 1).expand(1, 3, 32, 32)
        with torch.no_grad():
            if family == "qwenimage":  # a one-frame video
                mean = vae.encode(pixels.unsqueeze(2)).latent_dist.mean[0, :, 0]
            else:
                mean = vae.encode(pixels).latent_dist.mean[0]
        latent_shape = tuple(int(x) for x in row["latent_shape"])
        assert latent_shape == tuple(mean.shape) == (4, 16, 16)
        np.testing.assert_allclose(row["latent_mean"].reshape(latent_shape), mean.numpy(), atol=2e-4)
    if family == "qwenimage":  # unpadded: each caption its own length
        assert len(lengths) > 1
    else:  # Flux2KleinPipeline pads every caption to max_sequence_length
        assert lengths == {20}


def test_qwenimage_normalisation_is_what_the_pipeline_decodes(tiny_qwenimage: Path) -> None:
    """`(z - shift) * scale` with the manifest's factors, undone by QwenImagePipeline's decoding formula."""
    from finetune.diffusion.families import channel_norm

    vae = load_vae(pipeline_info(str(tiny_qwenimage)))
    factors = channel_norm(vae)
    z = torch.randn(2, 4, 6, 8)
    latents = sample_latents(z, torch.zeros_like(z), factors["scaling_factor"], factors["shift_factor"])
    # QwenImagePipeline.__call__ before vae.decode:
    mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1)
    torch.testing.assert_close(latents / inverse_std + mean, z, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(latents, z, atol=1e-2)  # the tiny VAE's statistics are not the identity


def test_flux2_normalisation_is_what_the_pipeline_decodes(tiny_flux2: Path) -> None:
    """The patchified latents' `(z - running_mean) / sqrt(running_var + eps)`, undone by
    Flux2KleinPipeline's decoding formula and unpatchify."""
    from diffusers import Flux2KleinPipeline

    from finetune.diffusion.families import batch_norm

    vae = load_vae(pipeline_info(str(tiny_flux2)))
    factors = batch_norm(vae)
    z = torch.randn(2, 4, 6, 8)
    patched = Flux2KleinPipeline._patchify_latents(z)
    latents = sample_latents(
        patched, torch.zeros_like(patched), factors["scaling_factor"], factors["shift_factor"]
    )
    # Flux2KleinPipeline.__call__ before vae.decode:
    bn_mean = vae.bn.running_mean.view(1, -1, 1, 1)
    bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    decoded = Flux2KleinPipeline._unpatchify_latents(latents * bn_std + bn_mean)
    torch.testing.assert_close(decoded, z, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(latents, patched, atol=1e-2)


def test_collate_pads_captions_of_several_lengths_with_a_mask() -> None:
    samples = [
        {
            "index": i,
            "is_prior": False,
            "latent_mean": torch.zeros(4, 2, 2),
            "prompt_embeds": torch.ones(n, 3),
        }
        for i, n in enumerate((2, 5))
    ]
    batch = collate(samples)
    assert batch["prompt_embeds"].shape == (2, 5, 3)
    assert batch["prompt_embeds_mask"].tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["prompt_embeds"][0, 2:].abs().sum() == 0
    same = collate([samples[1], {**samples[1], "index": 2}])
    assert "prompt_embeds_mask" not in same  # equal lengths: no mask, as the pipeline passes none


def _draws(mean, std, scale, shift, scheduler):
    """The latents, noise and noise levels the losses draw (seeded by the caller), per the scripts."""
    latents = (mean + std * torch.randn_like(mean) - shift) * scale
    noise = torch.randn_like(latents)
    timesteps, sigmas = flow_sigmas(scheduler, latents.shape[0], weighting_scheme="logit_normal")
    return latents, noise, timesteps, sigmas.view(-1, 1, 1, 1)


def _weighted(pred, target, sigmas):
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    weighting = compute_loss_weighting_for_sd3(weighting_scheme="logit_normal", sigmas=sigmas)
    return (weighting.float() * (pred.float() - target.float()) ** 2).reshape(target.shape[0], -1).mean()


def test_qwenimage_loss_is_the_diffusers_scripts(tiny_qwenimage: Path) -> None:
    """train_dreambooth_lora_qwen_image.py's steps with the real transformer (5-D latents, the text mask,
    `_unpack_latents` at the VAE scale) give the same loss; gradients reach every LoRA B."""
    from diffusers import QwenImagePipeline

    info = pipeline_info(str(tiny_qwenimage))
    transformer = with_default_lora(load_denoiser(info, torch.float32)).train()
    scheduler = load_noise_scheduler(info, None)
    vae_config = load_vae(info).config
    g = torch.Generator().manual_seed(0)
    batch = {
        "latent_mean": torch.randn(2, 4, 4, 6, generator=g),
        "latent_std": torch.rand(2, 4, 4, 6, generator=g) * 0.1,
        "prompt_embeds": torch.randn(2, 5, 16, generator=g),
        "prompt_embeds_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]),
        "is_prior": torch.tensor([False, False]),
    }
    shift, scale = list(vae_config.latents_mean), [1 / s for s in vae_config.latents_std]
    torch.manual_seed(3)
    loss = qwenimage_loss(
        transformer,
        scheduler,
        batch,
        scaling_factor=scale,
        shift_factor=shift,
        weighting_scheme="logit_normal",
    )
    loss.backward()
    # Every LoRA B gets a gradient but the last block's text-stream query and output, whose result
    # the transformer discards.
    unused = ("transformer_blocks.1.attn.add_q_proj.", "transformer_blocks.1.attn.to_add_out.")
    for name, param in transformer.named_parameters():
        if "lora_B" in name and not name.startswith(unused):
            assert param.grad is not None and param.grad.abs().sum() > 0, name

    torch.manual_seed(3)
    per_channel = torch.tensor(shift).view(1, 4, 1, 1), torch.tensor(scale).view(1, 4, 1, 1)
    latents, noise, timesteps, sigmas = _draws(
        batch["latent_mean"], batch["latent_std"], per_channel[1], per_channel[0], scheduler
    )
    model_input, noise = latents.unsqueeze(2), noise.unsqueeze(2)  # (B, C, 1, H, W), as the VAE gives
    noisy = (1.0 - sigmas.unsqueeze(2)) * model_input + sigmas.unsqueeze(2) * noise
    vae_scale_factor = 2 ** len(vae_config.temperal_downsample)
    h, w = model_input.shape[3], model_input.shape[4]
    with torch.no_grad():
        pred = transformer(
            hidden_states=QwenImagePipeline._pack_latents(noisy.permute(0, 2, 1, 3, 4), 2, 4, h, w),
            encoder_hidden_states=batch["prompt_embeds"],
            encoder_hidden_states_mask=batch["prompt_embeds_mask"],
            timestep=timesteps / 1000,
            img_shapes=[(1, h // 2, w // 2)] * 2,
            return_dict=False,
        )[0]
    pred = QwenImagePipeline._unpack_latents(
        pred, h * vae_scale_factor, w * vae_scale_factor, vae_scale_factor
    )
    expected = _weighted(pred, noise - model_input, sigmas.unsqueeze(2))
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_flux2_loss_is_the_diffusers_scripts(tiny_flux2: Path) -> None:
    """train_dreambooth_lora_flux2_klein.py's steps with the real transformer (patchify, BatchNorm
    normalisation, 4-axis ids, `_unpack_latents_with_ids`) give the same loss; gradients reach every
    LoRA B."""
    from diffusers import Flux2KleinPipeline

    from finetune.diffusion.families import batch_norm

    info = pipeline_info(str(tiny_flux2))
    transformer = with_default_lora(load_denoiser(info, torch.float32)).train()
    scheduler = load_noise_scheduler(info, None)
    factors = batch_norm(load_vae(info))
    g = torch.Generator().manual_seed(0)
    batch = {
        "latent_mean": torch.randn(2, 4, 4, 6, generator=g),
        "latent_std": torch.rand(2, 4, 4, 6, generator=g) * 0.1,
        "prompt_embeds": torch.randn(2, 7, 48, generator=g),
        "is_prior": torch.tensor([False, True]),
    }
    torch.manual_seed(3)
    loss = flux2_loss(
        transformer, scheduler, batch, weighting_scheme="logit_normal", prior_loss_weight=1.0, **factors
    )
    loss.backward()
    assert all(
        p.grad is not None and p.grad.abs().sum() > 0
        for n, p in transformer.named_parameters()
        if "lora_B" in n
    )

    torch.manual_seed(3)
    mean, std = (Flux2KleinPipeline._patchify_latents(batch[k]) for k in ("latent_mean", "latent_std"))
    scale = torch.tensor(factors["scaling_factor"]).view(1, -1, 1, 1)
    shift = torch.tensor(factors["shift_factor"]).view(1, -1, 1, 1)
    model_input, noise, timesteps, sigmas = _draws(mean, std, scale, shift, scheduler)
    ids = Flux2KleinPipeline._prepare_latent_ids(model_input)
    noisy = (1.0 - sigmas) * model_input + sigmas * noise
    packed = Flux2KleinPipeline._pack_latents(noisy)
    with torch.no_grad():
        pred = transformer(
            hidden_states=packed,
            timestep=timesteps / 1000,
            guidance=None,
            encoder_hidden_states=batch["prompt_embeds"],
            txt_ids=Flux2KleinPipeline._prepare_text_ids(batch["prompt_embeds"]),
            img_ids=ids,
            return_dict=False,
        )[0]
    pred = Flux2KleinPipeline._unpack_latents_with_ids(pred[:, : packed.size(1)], ids)
    # Prior preservation with weight 1: the mean of the two halves' means, each one image here.
    target = noise - model_input
    expected = _weighted(pred[:1], target[:1], sigmas[:1]) + _weighted(pred[1:], target[1:], sigmas[1:])
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_no_code_outside_the_table_tests_a_diffusion_family_by_name() -> None:
    """Family facts live in finetune/diffusion/families.py: elsewhere, code asks the row (`info.spec`)."""
    import re

    root = Path(__file__).resolve().parents[3] / "finetune"
    pattern = re.compile(r"family\s*(==|!=|in\s*\()|\.family\s+in\b")
    found = [
        f"{path.relative_to(root)}:{number}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        # model_card.py (layer 6) cannot import finetune.diffusion: it reads the family from the manifest.
        # text_encoder.py: CLIP text-encoder LoRA (SD, SDXL, Flux only) keeps its own dispatch for now.
        if path.name not in ("families.py", "model_card.py", "text_encoder.py")
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, found
