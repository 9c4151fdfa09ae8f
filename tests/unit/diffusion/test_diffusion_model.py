"""finetune.diffusion.model: pipeline detection and facts (SD, SDXL, SD3, Flux), LoRA targets, the\ndiffusers-format save and load, settings a pipeline family rules out (and the recipe's own checks),\nclass images, the card."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from diffusers import FlowMatchEulerDiscreteScheduler

from finetune.diffusion.cache import prepare_images
from finetune.diffusion.model import (
    add_lora,
    check_settings,
    guidance_embeds,
    load_denoiser,
    load_lora_into_unet,
    load_noise_scheduler,
    load_unet,
    lora_target_names,
    max_pixel_side,
    pipeline_info,
    pixel_multiple,
    save_lora,
    weight_dtype,
)
from finetune.errors import FinetuneError, RecipeError
from finetune.recipe import load_recipe
from finetune.recipe.diffusion import DIFFUSION_DEFAULT_LORA_TARGETS
from tests.diffusion_data import dreambooth_recipe, validated_recipe, with_default_lora, write_color_folder


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
            "StableDiffusion3Pipeline (SD3), FluxPipeline (Flux), QwenImagePipeline (Qwen-Image) and "
            "Flux2KleinPipeline (Flux.2 [klein])",
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

    write_color_folder(tmp_path / "class", captions="txt", count=1)
    data = dreambooth_recipe(
        tmp_path,
        tiny_sd,
        tmp_path / "photos",
        instance_prompt="a sks square",
        class_prompt="a square",
        num_class_images=3,
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


# --------------------------------------------------------------------------- SD3 and Flux pipelines

# The joint attention's projections (image and text streams): what the default LoRA targets adapt in
# SD3 and in Flux's double-stream blocks.
JOINT_ATTENTION = {"to_k", "to_q", "to_v", "to_out.0", "add_k_proj", "add_q_proj", "add_v_proj", "to_add_out"}


@pytest.mark.parametrize(
    ("family", "text_encoders", "tokenizers"),
    [
        (
            "sd3",
            ("text_encoder", "text_encoder_2", "text_encoder_3"),
            ("tokenizer", "tokenizer_2", "tokenizer_3"),
        ),
        ("flux", ("text_encoder", "text_encoder_2"), ("tokenizer", "tokenizer_2")),
    ],
    ids=["sd3", "flux"],
)
def test_transformer_pipeline_facts(
    family: str, text_encoders: tuple, tokenizers: tuple, pipeline: Path
) -> None:
    info = pipeline_info(str(pipeline))
    assert (info.family, info.denoiser_name, info.flow_matching) == (family, "transformer", True)
    assert info.text_encoder_names == text_encoders
    assert info.tokenizer_names == tokenizers
    # VAE /2 x patch 2 (SD3) or x the 2x2 packing (Flux; the real VAE: 8 x 2 = 16)
    assert pixel_multiple(info) == 4
    scheduler = load_noise_scheduler(info, None)
    assert isinstance(scheduler, FlowMatchEulerDiscreteScheduler)
    if family == "sd3":
        assert max_pixel_side(info) == 32 * 4  # pos_embed_max_size patches
        assert scheduler.config.shift == 3.0
        assert isinstance(load_noise_scheduler(info, "flow_matching"), FlowMatchEulerDiscreteScheduler)
        with pytest.raises(FinetuneError, match=r"diffusion.prediction_type: .* flow matching, not epsilon"):
            load_noise_scheduler(info, "epsilon")
    else:
        assert max_pixel_side(info) is None  # rotary position embeddings: no fixed grid
        assert guidance_embeds(info)
        assert (info.sequence_length(None), info.sequence_length(77)) == (512, 77)
        assert scheduler.config.use_dynamic_shifting
        # Dynamic shifting happens at inference (from the image size): the training schedule is unshifted.
        torch.testing.assert_close(scheduler.sigmas[:1000], torch.linspace(1.0, 0.001, 1000))


def test_unet_pipelines_refuse_flow_matching(tiny_sd: Path) -> None:
    info = pipeline_info(str(tiny_sd))
    assert not info.flow_matching and max_pixel_side(info) is None
    with pytest.raises(FinetuneError, match=r"diffusion.prediction_type: flow_matching is for flow-matching"):
        load_noise_scheduler(info, "flow_matching")


def test_an_sd3_folder_without_t5_is_refused(tmp_path: Path, tiny_sd3: Path) -> None:
    from finetune.diffusion.model import load_text_encoders

    folder = tmp_path / "no-t5"
    shutil.copytree(tiny_sd3, folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["text_encoder_3"] = [None, None]
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(FinetuneError, match=r"has no text_encoder_3 .* use the full pipeline"):
        load_text_encoders(pipeline_info(str(folder)))


def _adapted(model: torch.nn.Module) -> set[str]:
    return {name for name, module in model.named_modules() if hasattr(module, "lora_A")}


def test_default_lora_targets_are_diffusers_sd3_defaults(tiny_sd3: Path, tiny_sd: Path) -> None:
    info = pipeline_info(str(tiny_sd3))
    transformer = load_denoiser(info, torch.float32)
    linear = {n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    expected = {n for n in linear if ".attn." in n and n.split(".attn.", 1)[1] in JOINT_ATTENTION}
    with_default_lora(transformer)
    adapted = _adapted(transformer)
    assert adapted == expected
    # The joint attention's text stream too.
    assert {n.split(".attn.", 1)[1] for n in adapted} == JOINT_ATTENTION

    # UNets have no add_* / to_add_out projections: the default adapts what the four UNet names adapt.
    unets = [load_unet(pipeline_info(str(tiny_sd)), torch.float32) for _ in range(2)]
    for unet, targets in zip(
        unets, (DIFFUSION_DEFAULT_LORA_TARGETS, ["to_k", "to_q", "to_v", "to_out.0"]), strict=True
    ):
        add_lora(unet, rank=4, alpha=4, dropout=0.0, targets=targets, gradient_checkpointing=False)
    assert _adapted(unets[0]) == _adapted(unets[1]) != set()


def test_default_lora_targets_cover_the_flux_attention(tiny_flux: Path) -> None:
    transformer = with_default_lora(load_denoiser(pipeline_info(str(tiny_flux)), torch.float32))
    adapted = _adapted(transformer)
    double = {f"transformer_blocks.0.attn.{name}" for name in JOINT_ATTENTION}
    single = {f"single_transformer_blocks.0.attn.{name}" for name in ("to_q", "to_k", "to_v")}
    assert adapted == double | single  # not the feed-forward, modulation or embedding layers


@pytest.mark.parametrize(
    ("family", "targets"),
    [("sd3", ["to_q", "add_q_proj"]), ("flux", ["to_q", "add_q_proj", "ff.net.2"])],
    ids=["sd3", "flux"],
)
def test_transformer_lora_file_round_trip(
    tmp_path: Path, family: str, targets: list[str], pipeline: Path
) -> None:
    from safetensors.torch import load_file

    info = pipeline_info(str(pipeline))
    models = [load_denoiser(info, torch.float32) for _ in range(2)]
    for model in models:
        add_lora(model, rank=4, alpha=8, dropout=0.0, targets=targets, gradient_checkpointing=False)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in models[0].parameters():
            if p.requires_grad:
                p.copy_(torch.randn_like(p))
    save_lora(info, models[0], tmp_path)
    keys = list(load_file(str(tmp_path / "pytorch_lora_weights.safetensors")))
    assert keys and all(k.startswith("transformer.") and ".lora_" in k for k in keys)
    if family == "flux":
        assert any(k.startswith("transformer.single_transformer_blocks.0.attn.to_q.") for k in keys)
    load_lora_into_unet(models[1], tmp_path, prefix="transformer")
    loaded = dict(models[1].named_parameters())
    for name, value in models[0].named_parameters():
        if value.requires_grad:
            torch.testing.assert_close(loaded[name], value)
    if family == "sd3":
        with pytest.raises(FinetuneError, match=r"holds no unet\.\* LoRA weights"):
            load_lora_into_unet(models[1], tmp_path, prefix="unet")


# ------------------------------------------------------------------------ settings and recipe checks


def _problems(
    tmp_path: Path, model_path: str = "stabilityai/stable-diffusion-3-medium-diffusers", **diffusion
) -> str:
    """The problems load_recipe reports for a diffusion recipe of `model_path` with `diffusion` settings."""
    data = {
        "model": {"kind": "diffusion", "model_path": model_path},
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


def test_recipe_rejects_guidance_scale_for_epsilon_models(tmp_path: Path) -> None:
    text = _problems(tmp_path, "black-forest-labs/FLUX.1-dev", prediction_type="epsilon", guidance_scale=1.0)
    assert "diffusion.guidance_scale" in text and "flow matching (SD3, Flux) only" in text


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
