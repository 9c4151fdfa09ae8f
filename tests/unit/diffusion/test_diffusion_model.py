"""Pipeline detection, LoRA on the UNet, the diffusers-format save and load, class images, the card."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from finetune.diffusion.model import (
    add_lora,
    load_lora_into_unet,
    load_unet,
    lora_target_names,
    pipeline_info,
    save_lora,
    weight_dtype,
)
from finetune.errors import FinetuneError


@pytest.mark.parametrize(
    ("class_name", "text"),
    [
        (
            "SanaPipeline",
            "transformer-based pipeline that training does not support yet (the supported transformer-based "
            "pipelines are StableDiffusion3Pipeline",
        ),
        ("FluxImg2ImgPipeline", "use the text-to-image FluxPipeline"),
        ("StableDiffusion3Img2ImgPipeline", "use the text-to-image StableDiffusion3Pipeline"),
        ("StableDiffusionImg2ImgPipeline", "use the text-to-image StableDiffusionPipeline"),
        (
            "KandinskyPipeline",
            "supports StableDiffusionPipeline (SD 1.x/2.x), StableDiffusionXLPipeline (SDXL), "
            "StableDiffusion3Pipeline (SD3) and FluxPipeline (Flux)",
        ),
    ],
)
def test_unsupported_pipelines_are_refused_clearly(tmp_path: Path, class_name: str, text: str) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": class_name}))
    with pytest.raises(FinetuneError, match=r"model.model_path") as info:
        pipeline_info(str(tmp_path))
    assert text in str(info.value)


def test_a_folder_without_model_index_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FinetuneError, match=r"no model_index.json"):
        pipeline_info(str(tmp_path))


def test_families(tiny_sd: Path, tiny_sdxl: Path) -> None:
    assert pipeline_info(str(tiny_sd)).family == "sd"
    info = pipeline_info(str(tiny_sdxl))
    assert info.family == "sdxl" and info.text_encoder_names == ("text_encoder", "text_encoder_2")


def test_weight_dtype() -> None:
    assert weight_dtype("auto", "bf16") == torch.bfloat16
    assert weight_dtype("auto", "no") == torch.float32
    assert weight_dtype("fp32", "fp16") == torch.float32


def test_lora_save_load_round_trip_with_alpha_not_rank(tmp_path: Path, tiny_sd: Path) -> None:
    """What training saves loads back (ours for resume, diffusers' load_lora_weights) with the same outputs."""
    from diffusers import StableDiffusionPipeline

    info = pipeline_info(str(tiny_sd))
    torch.manual_seed(0)
    unet = load_unet(info, torch.float32)
    targets = ["to_q", "to_v"]
    trainable = add_lora(unet, rank=4, alpha=16, dropout=0.0, targets=targets, gradient_checkpointing=False)
    assert trainable > 0 and all(p.dtype == torch.float32 for p in unet.parameters() if p.requires_grad)
    with torch.no_grad():
        for name, p in unet.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # as if trained
    save_lora(info, unet, tmp_path)
    assert (tmp_path / "pytorch_lora_weights.safetensors").is_file()
    x, t, e = torch.randn(1, 4, 8, 8), torch.tensor([300]), torch.randn(1, 16, 32)
    with torch.no_grad():
        reference = unet(x, t, e).sample
        again = load_unet(info, torch.float32)
        add_lora(again, rank=4, alpha=16, dropout=0.0, targets=targets, gradient_checkpointing=False)
        load_lora_into_unet(again, tmp_path)
        torch.testing.assert_close(again(x, t, e).sample, reference)
        pipe = StableDiffusionPipeline.from_pretrained(
            tiny_sd, safety_checker=None, requires_safety_checker=False
        )
        base = pipe.unet(x, t, e).sample
        pipe.load_lora_weights(tmp_path)
        torch.testing.assert_close(pipe.unet(x, t, e).sample, reference)
        assert not torch.allclose(base, reference)


def test_all_linear_and_bad_targets(tiny_sd: Path) -> None:
    unet = load_unet(pipeline_info(str(tiny_sd)), torch.float32)
    names = lora_target_names(unet, "all-linear")
    assert (
        "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q" in names
        and "time_embedding.linear_1" in names
    )
    with pytest.raises(FinetuneError, match=r"lora.lora_target_modules"):
        add_lora(unet, rank=2, alpha=2, dropout=0.0, targets=["no_such_layer"], gradient_checkpointing=False)


def test_class_images_are_generated_until_there_are_enough(tmp_path: Path, tiny_sd: Path) -> None:
    from finetune.diffusion.sampling import ensure_class_images
    from finetune.recipe import validate_recipe
    from tests.diffusion_data import diffusion_recipe, write_color_folder

    write_color_folder(tmp_path / "class", captions="txt", count=1)
    data = diffusion_recipe(
        tmp_path,
        tiny_sd,
        tmp_path / "photos",
        type_="dreambooth",
        instance_prompt="a sks square",
        with_prior_preservation=True,
        class_data_dir=str(tmp_path / "class"),
        class_prompt="a square",
        num_class_images=3,
        class_generation_steps=1,
    )
    recipe = validate_recipe(data)
    info = pipeline_info(str(tiny_sd))
    assert (
        ensure_class_images(recipe.diffusion, info, seed=recipe.train.seed, device="cpu", log=lambda _: None)
        == 2
    )
    assert sorted(p.name for p in (tmp_path / "class").glob("class-*.png")) == [
        "class-00001.png",
        "class-00002.png",
    ]
    assert (
        ensure_class_images(recipe.diffusion, info, seed=recipe.train.seed, device="cpu", log=lambda _: None)
        == 0
    )


def test_model_card_shows_samples_and_how_to_load() -> None:
    from finetune.model_card import render_diffusion_model_card
    from finetune.recipe import recipe_to_dict, validate_recipe

    recipe = validate_recipe(
        {
            "model": {"kind": "diffusion", "model_path": "org/sd"},
            "data": {"datasets": [{"path": "photos", "type": "dreambooth"}]},
            "train": {"output_dir": "out"},
            "diffusion": {"instance_prompt": "a sks dog"},
        }
    )
    manifest = {
        "pipeline": {"class_name": "StableDiffusionPipeline"},
        "rows_in": 5,
        "rows_kept": 5,
        "buckets": {"512x512": 5},
    }
    card = render_diffusion_model_card(
        recipe=recipe_to_dict(recipe),
        manifest=manifest,
        metrics={"step": 10},
        samples=[("a sks dog", "samples/step-10/00-00-a.png")],
    )
    assert (
        "library_name: diffusers" in card
        and "base_model: org/sd" in card
        and "instance_prompt: a sks dog" in card
    )
    assert "![a sks dog](samples/step-10/00-00-a.png)" in card and "pipeline.load_lora_weights(" in card
