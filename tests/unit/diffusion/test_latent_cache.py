"""prepare_images: cached latents and text embeddings, manifest, fingerprint, cache reuse, pairing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from finetune.data.cache import compute_fingerprint
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
