"""prepare_images: cached latents and text embeddings (SD, SDXL, SD3, Flux), manifest, fingerprint,
cache reuse, pairing, resolutions a pipeline cannot take."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from finetune.data.prepare.cache import compute_fingerprint
from finetune.diffusion import images as img
from finetune.diffusion.cache import fingerprint_inputs, prepare_images
from finetune.diffusion.loader import make_loader
from finetune.diffusion.model import (
    encode_pixels,
    encode_prompts,
    load_text_encoders,
    load_vae,
    pipeline_info,
)
from finetune.errors import RecipeError
from finetune.recipe import Recipe
from tests.diffusion_data import (
    COLORS,
    caption,
    color_of,
    validated_recipe,
    write_color_folder,
)


def _fingerprint(recipe: Recipe) -> str:
    info = pipeline_info(recipe.model.model_path, None, recipe.diffusion.vae_path)
    return compute_fingerprint(fingerprint_inputs(recipe, info))


def test_build_manifest_and_cache_hit(tmp_path: Path, tiny_sd: Path) -> None:
    folder = tmp_path / "imgs"
    write_color_folder(folder, captions="jsonl", count=6)
    (folder / "broken.png").write_bytes(b"not a png")
    Image.new("RGB", (6, 6)).save(folder / "small.png")
    with open(folder / "metadata.jsonl", "a") as f:
        f.write(json.dumps({"file_name": "broken.png", "text": "x"}) + "\n")
        f.write(json.dumps({"file_name": "small.png", "text": "y"}) + "\n")
    recipe = validated_recipe(tmp_path, tiny_sd, folder)
    lines: list[str] = []
    first = prepare_images(recipe, log=lines.append)
    m = first.manifest
    assert first.source == "built" and len(first.train) == 6
    assert (m["rows_in"], m["rows_kept"], m["rows_dropped"]) == (8, 6, 2)
    assert m["dropped"] == {"too_small": 1, "unreadable": 1}
    assert {s["key"] for s in m["bad_row_samples"]} == {"broken.png", "small.png"}
    assert sum(m["buckets"].values()) == 6 and len(m["buckets"]) >= 2  # squares, wide and tall
    assert "dropped (too_small=1, unreadable=1)" in lines[-1]
    # Each row's bucket is its image's shape.
    for row in first.train:
        h, w = row["height"], row["width"]
        ow, oh = row["original_width"], row["original_height"]
        assert (h > w) == (oh > ow) and (w > h) == (ow > oh)
        assert row["latent_shape"] == [4, h // 2, w // 2]
    second = prepare_images(recipe, log=lines.append)
    assert second.source == "cache" and second.path == first.path and second.manifest == m
    assert any("nothing to encode" in line for line in lines)


def test_fingerprint_changes_exactly_when_the_output_would(tmp_path: Path, tiny_sd: Path) -> None:
    folder = tmp_path / "imgs"
    write_color_folder(folder, captions="txt", count=3)
    base = _fingerprint(validated_recipe(tmp_path, tiny_sd, folder))
    # Not changing the output: same inputs again, other paths, unrelated files, training settings.
    moved = tmp_path / "moved"
    shutil.copytree(folder, moved)
    (moved / "README.md").write_text("notes")
    same = validated_recipe(tmp_path, tiny_sd, moved, snr_gamma=5.0, validation_prompts=["x"])
    same.train.lr = 0.5
    assert _fingerprint(same) == base
    assert _fingerprint(validated_recipe(tmp_path, tiny_sd, folder, encode_batch_size=1)) == base
    # Changing it.
    assert _fingerprint(validated_recipe(tmp_path, tiny_sd, folder, resolution=36)) != base
    assert _fingerprint(validated_recipe(tmp_path, tiny_sd, folder, random_flip=True)) != base
    assert _fingerprint(validated_recipe(tmp_path, tiny_sd, folder, center_crop=True)) != base
    (moved / "red.txt").write_text("a different caption")
    assert _fingerprint(validated_recipe(tmp_path, tiny_sd, moved)) != base
    (moved / "red.txt").write_text(caption("red") + "\n")
    assert _fingerprint(validated_recipe(tmp_path, tiny_sd, moved)) == base
    data = bytearray((moved / "green.png").read_bytes())
    data[-20] ^= 1  # one byte of one image
    (moved / "green.png").write_bytes(bytes(data))
    assert _fingerprint(validated_recipe(tmp_path, tiny_sd, moved)) != base
    other_vae = tmp_path / "other-sd"
    shutil.copytree(tiny_sd, other_vae)
    config = json.loads((other_vae / "vae" / "config.json").read_text())
    (other_vae / "vae" / "config.json").write_text(json.dumps({**config, "scaling_factor": 0.5}))
    assert _fingerprint(validated_recipe(tmp_path, other_vae, folder)) != base


def test_latents_stay_paired_with_their_captions_under_shuffle(tmp_path: Path, tiny_sd: Path) -> None:
    """Solid-colour images named in their captions: after shuffling, each sample's latent must be the
    VAE encoding of the image its caption names, and its embeddings those of that caption."""
    folder = tmp_path / "imgs"
    write_color_folder(folder, captions="jsonl")
    recipe = validated_recipe(tmp_path, tiny_sd, folder, random_flip=True, center_crop=True)
    prepared = prepare_images(recipe, log=lambda _: None)
    info = pipeline_info(str(tiny_sd))
    vae = load_vae(info)
    tokenizers, encoders = load_text_encoders(info)
    captions = dict(zip(prepared.train["index"], prepared.train["caption"], strict=True))
    loader = make_loader(prepared.train, batch_size=2, seed=3, drop_last=False)
    expected: dict = {}  # (caption, h, w) -> (mean, std, embeddings), each encoded once

    def encoded(text: str, h: int, w: int):
        if (text, h, w) not in expected:
            solid = Image.new("RGB", (w, h), COLORS[color_of(text)])
            mean, std = encode_pixels(vae, torch.from_numpy(img.to_pixels(solid))[None])
            embeds = encode_prompts(tokenizers, encoders, [text], "sd")["prompt_embeds"][0]
            expected[text, h, w] = (mean[0], std[0], embeds)
        return expected[text, h, w]

    orders = []
    for epoch in range(2):
        loader.batch_sampler.set_epoch(epoch)
        order = []
        for batch in loader:
            h, w = batch["latent_mean"].shape[-2] * 2, batch["latent_mean"].shape[-1] * 2
            for j, index in enumerate(batch["index"].tolist()):
                mean, std, embeds = encoded(captions[index], h, w)
                torch.testing.assert_close(batch["latent_mean"][j], mean, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(batch["latent_std"][j], std, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(batch["prompt_embeds"][j], embeds, atol=1e-5, rtol=1e-5)
                order.append(index)
        orders.append(order)
    assert sorted(orders[0]) == sorted(captions) and orders[0] != sorted(orders[0])  # shuffled, all seen
    assert orders[0] != orders[1]


def test_flipped_latents_are_the_flipped_image(tmp_path: Path, tiny_sd: Path) -> None:
    folder = tmp_path / "imgs"
    folder.mkdir()
    half = Image.new("RGB", (32, 32), (250, 0, 0))
    half.paste((0, 0, 250), (16, 0, 32, 32))
    half.save(folder / "half.png")
    (folder / "half.txt").write_text("left red right blue")
    prepared = prepare_images(
        validated_recipe(tmp_path, tiny_sd, folder, random_flip=True), log=lambda _: None
    )
    row = prepared.train.with_format("numpy")[0]
    vae = load_vae(pipeline_info(str(tiny_sd)))
    plain = encode_pixels(vae, torch.from_numpy(img.to_pixels(half))[None])[0]
    flipped = encode_pixels(vae, torch.from_numpy(img.to_pixels(img.flip(half)))[None])[0]
    np.testing.assert_allclose(row["latent_mean"], plain.flatten().numpy(), atol=1e-4)
    np.testing.assert_allclose(row["latent_mean_flipped"], flipped.flatten().numpy(), atol=1e-4)
    assert not np.allclose(row["latent_mean"], row["latent_mean_flipped"], atol=1e-3)


def test_sdxl_rows_carry_pooled_embeddings_and_size_conditioning(tmp_path: Path, tiny_sdxl: Path) -> None:
    folder = tmp_path / "imgs"
    write_color_folder(folder, captions="txt", count=3)
    prepared = prepare_images(validated_recipe(tmp_path, tiny_sdxl, folder), log=lambda _: None)
    assert prepared.manifest["pipeline"]["family"] == "sdxl"
    loader = make_loader(prepared.train, batch_size=1, seed=0, drop_last=False)
    batch = next(iter(loader))
    assert batch["prompt_embeds"].shape == (1, 16, 64) and batch["pooled_prompt_embeds"].shape == (1, 32)
    oh, ow, top, left, h, w = batch["time_ids"][0].tolist()
    assert (h, w) == (batch["latent_mean"].shape[-2] * 2, batch["latent_mean"].shape[-1] * 2)
    assert oh > 0 and ow > 0 and top >= 0 and left >= 0


def test_resolution_must_fit_the_pipeline(tmp_path: Path, tiny_sd: Path) -> None:
    write_color_folder(tmp_path / "imgs", captions="txt", count=1)
    with pytest.raises(Exception, match=r"resolution: 33 is not a multiple of 4"):
        prepare_images(
            validated_recipe(tmp_path, tiny_sd, tmp_path / "imgs", resolution=33), log=lambda _: None
        )


# --------------------------------------------------------------------------------- SD3 and Flux


@pytest.mark.parametrize(
    ("family", "pipeline_class", "count", "latents", "prompt_shape"),
    [
        ("sd3", "StableDiffusion3Pipeline", 5, (1.5305, 0.0609), [16 + 20, 32]),  # CLIP + T5 tokens, T5 width
        ("flux", "FluxPipeline", 4, (0.3611, 0.1159), [20, 32]),  # T5 tokens x T5 width
    ],
    ids=["sd3", "flux"],
)
def test_cached_embeddings_are_the_pipelines_and_pair_with_their_images(
    tmp_path: Path,
    family: str,
    pipeline_class: str,
    count: int,
    latents: tuple,
    prompt_shape: list[int],
    pipeline: Path,
) -> None:
    import diffusers

    folder = tmp_path / "imgs"
    write_color_folder(folder, captions="jsonl", count=count)
    recipe = validated_recipe(tmp_path, pipeline, folder, max_sequence_length=20, aspect_ratio_buckets=False)
    prepared = prepare_images(recipe, log=lambda _: None)
    manifest = prepared.manifest
    assert (manifest["latents"]["scaling_factor"], manifest["latents"]["shift_factor"]) == latents
    if family == "flux":
        assert manifest["fingerprint_inputs"]["text"] == {"max_sequence_length": 20}
        assert [p["subfolder"] for p in manifest["fingerprint_inputs"]["text_encoders"]] == [
            "text_encoder",
            "text_encoder_2",
            "tokenizer",
            "tokenizer_2",
        ]
    pipe = getattr(diffusers, pipeline_class).from_pretrained(pipeline)
    vae = load_vae(pipeline_info(str(pipeline)))
    assert len(prepared.train) == count
    for row in prepared.train.with_format("numpy"):
        assert list(row["prompt_shape"]) == prompt_shape
        with torch.no_grad():
            if family == "sd3":
                embeds, _, pooled, _ = pipe.encode_prompt(
                    row["caption"], None, None, do_classifier_free_guidance=False, max_sequence_length=20
                )
            else:
                embeds, pooled, _ = pipe.encode_prompt(row["caption"], None, max_sequence_length=20)
        np.testing.assert_allclose(row["prompt_embeds"].reshape(prompt_shape), embeds[0].numpy(), atol=1e-5)
        np.testing.assert_allclose(row["pooled_prompt_embeds"], pooled[0].numpy(), atol=1e-5)
        # The latents are the raw VAE mean of this caption's solid-colour image (not shifted, not scaled).
        shape = tuple(int(x) for x in row["latent_shape"])
        rgb = torch.tensor(COLORS[color_of(str(row["caption"]))], dtype=torch.float32) / 127.5 - 1
        with torch.no_grad():
            mean = vae.encode(rgb.view(1, 3, 1, 1).expand(1, 3, 32, 32)).latent_dist.mean[0]
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


@pytest.mark.parametrize(
    ("family", "resolution", "message"),
    [
        ("sd3", 160, r"diffusion.resolution: 160 gives buckets with sides up to \d+ px, beyond the 128"),
        ("flux", 30, r"diffusion.resolution: 30 is not a multiple of 4 .* use e.g. 32"),
    ],
    ids=["sd3-beyond-the-position-embeddings", "flux-sides-that-do-not-pack"],
)
def test_resolutions_the_transformer_cannot_take_are_refused(
    tmp_path: Path, family: str, resolution: int, message: str, pipeline: Path
) -> None:
    folder = tmp_path / "imgs"
    write_color_folder(folder, count=2)
    recipe = validated_recipe(tmp_path, pipeline, folder, resolution=resolution)
    with pytest.raises(RecipeError, match=message):
        prepare_images(recipe, log=lambda _: None)
