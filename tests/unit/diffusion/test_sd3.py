"""Stable Diffusion 3: pipeline facts, flow-matching loss, LoRA targets and files, cached embeddings, recipe checks."""

from __future__ import annotations

import math
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
    load_denoiser,
    load_lora_into_unet,
    load_noise_scheduler,
    load_unet,
    load_vae,
    max_pixel_side,
    pipeline_info,
    pixel_multiple,
    save_lora,
)
from finetune.diffusion.objective import flow_matching_loss, flow_sigmas
from finetune.errors import FinetuneError, RecipeError
from finetune.recipe import load_recipe
from finetune.recipe.diffusion import DIFFUSION_DEFAULT_LORA_TARGETS
from tests.diffusion_data import COLORS, color_of, validated_recipe, write_color_folder

SD3_TARGETS = {"to_k", "to_q", "to_v", "to_out.0", "add_k_proj", "add_q_proj", "add_v_proj", "to_add_out"}


# ------------------------------------------------------------------------------------- pipeline


def test_sd3_pipeline_facts(tiny_sd3: Path) -> None:
    info = pipeline_info(str(tiny_sd3))
    assert (info.family, info.denoiser_name, info.flow_matching) == ("sd3", "transformer", True)
    assert info.text_encoder_names == ("text_encoder", "text_encoder_2", "text_encoder_3")
    assert info.tokenizer_names == ("tokenizer", "tokenizer_2", "tokenizer_3")
    assert pixel_multiple(info) == 4  # VAE /2 x patch 2
    assert max_pixel_side(info) == 32 * 4  # pos_embed_max_size patches
    scheduler = load_noise_scheduler(info, None)
    assert isinstance(scheduler, FlowMatchEulerDiscreteScheduler) and scheduler.config.shift == 3.0
    assert isinstance(load_noise_scheduler(info, "flow_matching"), FlowMatchEulerDiscreteScheduler)
    with pytest.raises(FinetuneError, match=r"diffusion.prediction_type: .* flow matching, not epsilon"):
        load_noise_scheduler(info, "epsilon")


def test_unet_pipelines_refuse_flow_matching(tiny_sd: Path) -> None:
    info = pipeline_info(str(tiny_sd))
    assert not info.flow_matching and max_pixel_side(info) is None
    with pytest.raises(FinetuneError, match=r"diffusion.prediction_type: flow_matching is for flow-matching"):
        load_noise_scheduler(info, "flow_matching")


# ------------------------------------------------------------------------------------- objective


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


def _batch(prior: list[bool]) -> dict:
    g = torch.Generator().manual_seed(0)
    n = len(prior)
    return {
        "latent_mean": torch.randn(n, 16, 4, 4, generator=g),
        "latent_std": torch.rand(n, 16, 4, 4, generator=g) * 0.1,
        "prompt_embeds": torch.randn(n, 5, 8, generator=g),
        "pooled_prompt_embeds": torch.randn(n, 6, generator=g),
        "is_prior": torch.tensor(prior),
    }


def _by_hand(batch, scheme, *, scaling, shift_factor, shift, prior_weight, logit_mean, logit_std, mode_scale):
    """The same draws in the same order; sigmas from the shifted schedule's formula, not the scheduler."""
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
    sigma = (shift * t / (1 + (shift - 1) * t)).view(-1, 1, 1, 1)
    noisy = (1 - sigma) * latents.double() + sigma * noise.double()
    target = noise.double() - latents.double()
    weight = {"sigma_sqrt": sigma**-2, "cosmap": 2 / (math.pi * (1 - 2 * sigma + 2 * sigma**2))}.get(
        scheme, 1.0
    )
    per = (weight * target**2).mean(dim=(1, 2, 3))
    prior = batch["is_prior"]
    loss = per.mean() if not prior.any() else per[~prior].mean() + prior_weight * per[prior].mean()
    return loss, noisy, sigma.flatten() * steps


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
    batch = _batch(prior)
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
    expected, noisy, timesteps = _by_hand(
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
        "prompt_embeds": torch.randn(2, 16 + 20, 32, generator=g),
        "pooled_prompt_embeds": torch.randn(2, 32, generator=g),
        "is_prior": torch.tensor([False, True]),
    }
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


def test_an_sd3_folder_without_t5_is_refused(tmp_path: Path, tiny_sd3: Path) -> None:
    import json
    import shutil

    from finetune.diffusion.model import load_text_encoders

    folder = tmp_path / "no-t5"
    shutil.copytree(tiny_sd3, folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["text_encoder_3"] = [None, None]
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(FinetuneError, match=r"has no text_encoder_3 .* use the full pipeline"):
        load_text_encoders(pipeline_info(str(folder)))


# ------------------------------------------------------------------------------------------ LoRA


def _adapted(model: torch.nn.Module) -> set[str]:
    return {name for name, module in model.named_modules() if hasattr(module, "lora_A")}


def test_default_lora_targets_are_diffusers_sd3_defaults(tiny_sd3: Path, tiny_sd: Path) -> None:
    info = pipeline_info(str(tiny_sd3))
    transformer = load_denoiser(info, torch.float32)
    linear = {n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    expected = {n for n in linear if ".attn." in n and n.split(".attn.", 1)[1] in SD3_TARGETS}
    add_lora(
        transformer,
        rank=4,
        alpha=4,
        dropout=0.0,
        targets=DIFFUSION_DEFAULT_LORA_TARGETS,
        gradient_checkpointing=False,
    )
    adapted = _adapted(transformer)
    assert adapted == expected
    assert {n.split(".attn.", 1)[1] for n in adapted} == SD3_TARGETS  # the joint attention's text stream too

    # UNets have no add_* / to_add_out projections: the default adapts what the four UNet names adapt.
    unets = [load_unet(pipeline_info(str(tiny_sd)), torch.float32) for _ in range(2)]
    for unet, targets in zip(
        unets, (DIFFUSION_DEFAULT_LORA_TARGETS, ["to_k", "to_q", "to_v", "to_out.0"]), strict=True
    ):
        add_lora(unet, rank=4, alpha=4, dropout=0.0, targets=targets, gradient_checkpointing=False)
    assert _adapted(unets[0]) == _adapted(unets[1]) != set()


def test_lora_file_round_trip_and_prefix(tmp_path: Path, tiny_sd3: Path) -> None:
    info = pipeline_info(str(tiny_sd3))
    models = [load_denoiser(info, torch.float32) for _ in range(2)]
    for model in models:
        add_lora(
            model, rank=4, alpha=8, dropout=0.0, targets=["to_q", "add_q_proj"], gradient_checkpointing=False
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
    load_lora_into_unet(models[1], tmp_path, prefix="transformer")
    trained = [(n, p) for n, p in models[0].named_parameters() if p.requires_grad]
    loaded = dict(models[1].named_parameters())
    for name, value in trained:
        torch.testing.assert_close(loaded[name], value)
    with pytest.raises(FinetuneError, match=r"holds no unet\.\* LoRA weights"):
        load_lora_into_unet(models[1], tmp_path, prefix="unet")


# ----------------------------------------------------------------------------------------- cache


def test_cached_sd3_embeddings_are_the_pipelines_and_pair_with_their_images(
    tmp_path: Path, tiny_sd3: Path
) -> None:
    from diffusers import StableDiffusion3Pipeline

    folder = tmp_path / "imgs"
    write_color_folder(folder, captions="jsonl", count=5)
    recipe = validated_recipe(tmp_path, tiny_sd3, folder, max_sequence_length=20, aspect_ratio_buckets=False)
    prepared = prepare_images(recipe, log=lambda _: None)
    latents = prepared.manifest["latents"]
    assert (latents["scaling_factor"], latents["shift_factor"]) == (1.5305, 0.0609)
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3)
    vae = load_vae(pipeline_info(str(tiny_sd3)))
    assert len(prepared.train) == 5
    for row in prepared.train.with_format("numpy"):
        assert list(row["prompt_shape"]) == [16 + 20, 32]  # CLIP tokens + T5 tokens, T5 width
        with torch.no_grad():
            embeds, _, pooled, _ = pipe.encode_prompt(
                row["caption"], None, None, do_classifier_free_guidance=False, max_sequence_length=20
            )
        np.testing.assert_allclose(row["prompt_embeds"].reshape(36, 32), embeds[0].numpy(), atol=1e-5)
        np.testing.assert_allclose(row["pooled_prompt_embeds"], pooled[0].numpy(), atol=1e-5)
        # The latents are the raw VAE mean of this caption's solid-colour image (not shifted, not scaled).
        shape = tuple(int(x) for x in row["latent_shape"])
        rgb = torch.tensor(COLORS[color_of(str(row["caption"]))], dtype=torch.float32) / 127.5 - 1
        pixels = rgb.view(1, 3, 1, 1).expand(1, 3, 32, 32)
        with torch.no_grad():
            mean = vae.encode(pixels).latent_dist.mean[0]
        assert shape == tuple(mean.shape) == (16, 16, 16)
        np.testing.assert_allclose(row["latent_mean"].reshape(shape), mean.numpy(), atol=2e-4)


def test_max_sequence_length_is_in_the_sd3_fingerprint_only(
    tmp_path: Path, tiny_sd3: Path, tiny_sd: Path
) -> None:
    folder = tmp_path / "imgs"
    write_color_folder(folder, count=2)

    def fingerprint(pipeline: Path, **diffusion) -> tuple[str, dict]:
        recipe = validated_recipe(tmp_path, pipeline, folder, **diffusion)
        inputs = fingerprint_inputs(recipe, pipeline_info(str(pipeline)))
        return compute_fingerprint(inputs), inputs

    (short, inputs), (long, _) = fingerprint(tiny_sd3, max_sequence_length=12), fingerprint(tiny_sd3)
    assert short != long and inputs["text"] == {"max_sequence_length": 12}
    assert [p["subfolder"] for p in inputs["text_encoders"]][-1] == "tokenizer_3"
    assert "text" not in fingerprint(tiny_sd)[1]


def test_buckets_beyond_the_position_embeddings_are_refused(tmp_path: Path, tiny_sd3: Path) -> None:
    folder = tmp_path / "imgs"
    write_color_folder(folder, count=2)
    recipe = validated_recipe(tmp_path, tiny_sd3, folder, resolution=160)
    with pytest.raises(
        RecipeError, match=r"diffusion.resolution: 160 gives buckets with sides up to \d+ px, beyond the 128"
    ):
        prepare_images(recipe, log=lambda _: None)


# ---------------------------------------------------------------------------------------- recipe


def _problems(tmp_path: Path, **diffusion) -> str:
    data = {
        "model": {"kind": "diffusion", "model_path": "stabilityai/stable-diffusion-3-medium-diffusers"},
        "data": {"datasets": [{"path": "photos", "type": "images"}]},
        "train": {"output_dir": "out"},
        "diffusion": diffusion,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    return str(info.value)


def test_recipe_rejects_contradicting_objective_settings(tmp_path: Path) -> None:
    text = _problems(tmp_path, prediction_type="flow_matching", snr_gamma=5.0, noise_offset=0.1)
    assert "diffusion.snr_gamma" in text and "flow matching weights timesteps with weighting_scheme" in text
    assert "diffusion.noise_offset" in text
    text = _problems(tmp_path, prediction_type="epsilon", weighting_scheme="mode", max_sequence_length=77)
    assert "diffusion.weighting_scheme" in text and "diffusion.max_sequence_length" in text
    assert "not prediction_type epsilon" in text
    text = _problems(tmp_path, weighting_scheme="mode", logit_std=2.0)
    assert "diffusion.logit_std" in text and "weighting_scheme logit_normal only (it is mode)" in text
    text = _problems(tmp_path, mode_scale=1.0)
    assert "diffusion.mode_scale" in text and "weighting_scheme mode only" in text
    assert "diffusion.max_sequence_length" in _problems(tmp_path, max_sequence_length=600)


def test_settings_that_the_pipeline_family_rules_out(tmp_path: Path, tiny_sd3: Path, tiny_sd: Path) -> None:
    folder = tmp_path / "imgs"
    write_color_folder(folder, count=2)
    fine = validated_recipe(tmp_path, tiny_sd3, folder, weighting_scheme="cosmap", max_sequence_length=32)
    check_settings(pipeline_info(str(tiny_sd3)), fine.diffusion)
    bad = validated_recipe(
        tmp_path, tiny_sd3, folder, snr_gamma=5.0, noise_offset=0.05, prediction_type="v_prediction"
    )
    with pytest.raises(RecipeError) as info:
        prepare_images(bad, log=lambda _: None)  # before anything is encoded
    lines = str(info.value).splitlines()[1:]
    assert [line.split(":")[0].strip() for line in lines] == [
        "diffusion.prediction_type",
        "diffusion.snr_gamma",
        "diffusion.noise_offset",
    ]
    unet = validated_recipe(tmp_path, tiny_sd, folder, weighting_scheme="none", max_sequence_length=77)
    with pytest.raises(RecipeError, match=r"diffusion.weighting_scheme: applies to flow-matching pipelines"):
        check_settings(pipeline_info(str(tiny_sd)), unet.diffusion)
    assert not (tmp_path / "prepared").exists()
