"""Images, folders, recipes and runs for the diffusion tests (generated here: nothing is downloaded).

Every image is a solid colour named in its caption ("a red square"), so a test can tell from a
caption which image a cached latent must come from.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from PIL import Image

COLORS = {
    "red": (230, 20, 20),
    "green": (20, 200, 40),
    "blue": (20, 40, 230),
    "white": (250, 250, 250),
    "black": (5, 5, 5),
    "yellow": (240, 230, 20),
    "purple": (140, 20, 160),
    "cyan": (20, 220, 220),
}
# (width, height): squares, wide and tall images -> several buckets at 32 px.
SIZES = [(40, 40), (64, 32), (32, 64), (48, 48), (72, 36), (36, 36), (30, 60), (44, 44)]


def caption(color: str) -> str:
    return f"a {color} square"


def color_of(text: str) -> str:
    return text.split()[1]


def write_color_folder(folder: Path, *, captions: str = "jsonl", count: int = len(COLORS)) -> list[str]:
    """Solid-colour images of several aspect ratios with captions in metadata.jsonl, metadata.csv or
    .txt sidecars; returns the colour names in file order."""
    folder.mkdir(parents=True, exist_ok=True)
    names = list(COLORS)[:count]
    rows = []
    for name, size in zip(names, SIZES, strict=False):
        Image.new("RGB", size, COLORS[name]).save(folder / f"{name}.png")
        rows.append({"file_name": f"{name}.png", "text": caption(name)})
        if captions == "txt":
            (folder / f"{name}.txt").write_text(caption(name) + "\n")
    if captions == "jsonl":
        (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif captions == "csv":
        with open(folder / "metadata.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["file_name", "text"])
            writer.writeheader()
            writer.writerows(rows)
    return names


def diffusion_recipe(tmp: Path, pipeline: Path, data: Path, *, type_: str = "images", **diffusion) -> dict:
    """A small CPU diffusion recipe (32 px, batch 2, fp32) as a dict."""
    return {
        "model": {"kind": "diffusion", "model_path": str(pipeline)},
        "data": {
            "datasets": [{"path": str(data), "type": type_}],
            "dataset_prepared_path": str(tmp / "prepared"),
            "dataloader_num_workers": 0,
            "dataloader_prefetch_factor": None,
        },
        "train": {
            "output_dir": str(tmp / "out"),
            "micro_batch_size": 2,
            "max_steps": 4,
            "lr": 1e-3,
            "mixed_precision": "no",
            "save_epochs": 0,
            "log_format": "structured",
        },
        "lora": {"lora_rank": 4, "lora_alpha": 8},
        "diffusion": {"resolution": 32, "encode_batch_size": 4, **diffusion},
    }


def dreambooth_recipe(
    tmp: Path,
    pipeline: Path,
    photos: Path,
    *,
    instance_prompt: str,
    class_prompt: str,
    num_class_images: int,
    **diffusion,
) -> dict:
    """`diffusion_recipe` for DreamBooth with prior preservation: class images in tmp/class, the missing
    ones generated with one denoising step."""
    return diffusion_recipe(
        tmp,
        pipeline,
        photos,
        type_="dreambooth",
        instance_prompt=instance_prompt,
        with_prior_preservation=True,
        class_data_dir=str(tmp / "class"),
        class_prompt=class_prompt,
        num_class_images=num_class_images,
        class_generation_steps=1,
        **diffusion,
    )


def validated_recipe(tmp: Path, pipeline: Path, data: Path, **diffusion):
    """`diffusion_recipe(...)` validated into a Recipe."""
    from finetune.recipe import validate_recipe

    return validate_recipe(diffusion_recipe(tmp, pipeline, data, **diffusion))


def with_default_lora(denoiser, *, gradient_checkpointing: bool = False):
    """`denoiser` (a UNet or transformer) with LoRA on the recipe's default targets (rank 4, alpha 4,
    no dropout)."""
    from finetune.diffusion.model import add_lora
    from finetune.recipe.diffusion import DIFFUSION_DEFAULT_LORA_TARGETS

    add_lora(
        denoiser,
        rank=4,
        alpha=4,
        dropout=0.0,
        targets=DIFFUSION_DEFAULT_LORA_TARGETS,
        gradient_checkpointing=gradient_checkpointing,
    )
    return denoiser


def assert_lora_changes_generation(pipe, out: Path, **call) -> None:
    """`pipe.load_lora_weights(out)` loads the trained LoRA and changes a seeded 32 px generation."""
    import numpy as np
    import torch

    pipe.set_progress_bar_config(disable=True)

    def generate():
        generator = torch.Generator().manual_seed(0)
        return pipe(
            prompt="a red square",  # by name: Flux2KleinPipeline's first argument is `image`
            num_inference_steps=2,
            height=32,
            width=32,
            generator=generator,
            output_type="np",
            **call,
        ).images

    without = generate()
    pipe.load_lora_weights(out)
    with_lora = generate()
    assert with_lora.shape == (1, 32, 32, 3) and np.isfinite(with_lora).all()
    assert np.abs(with_lora - without).max() > 1e-4


def assert_resumes_exactly(trained: dict, from_step: int, *extra: str) -> None:
    """A run resumed from checkpoints/step-`from_step` of trained["tmp"]/out (validation off) logs the
    same losses for the later steps as the uninterrupted run, to 1e-6, and saves the same final LoRA
    weights (with use_ema, the EMA's: restored from the checkpoint's extra state)."""
    import pytest
    import torch
    from safetensors.torch import load_file

    from tests.integration._run import progress, step_losses, train_here

    assert trained["train"].returncode == 0
    tmp = trained["tmp"]
    checkpoint = tmp / "out" / "checkpoints" / f"step-{from_step}"
    overrides = ["--train.output_dir", str(tmp / "resumed"), "--train.load_checkpoint_path", str(checkpoint)]
    overrides += ["--diffusion.validation_prompts", "[]", "--diffusion.validation_steps", "null", *extra]
    resumed = train_here(trained["recipe"], *overrides)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resumed from {checkpoint} at step {from_step}" in resumed.stdout + resumed.stderr
    reference, after = step_losses(progress(tmp / "out")), step_losses(progress(tmp / "resumed"))
    later = sorted(s for s in reference if s > from_step)
    assert later and sorted(after) == later
    for step in later:
        assert after[step] == pytest.approx(reference[step], abs=1e-6), step
    want = load_file(tmp / "out" / "pytorch_lora_weights.safetensors")
    got = load_file(tmp / "resumed" / "pytorch_lora_weights.safetensors")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6, msg=name)


def prepare_and_train(
    tmp: Path,
    family: str,
    *,
    steps: int,
    prepare: bool = True,
    captions: str = "jsonl",
    train: dict | None = None,
    **diffusion,
) -> dict:
    """A tiny pipeline of `family` (sd, sdxl, sd3, flux, qwenimage, flux2) and 8 coloured images (`captions` as in
    write_color_folder), prepared with the CLI (unless `prepare` is False), then trained `steps` steps
    (accumulation 2, checkpoints every 3 steps, a validation sample every 3 steps, LoRA dropout so
    resume must replay the masks) through finetune/train.py's main in this process (tests/inprocess.py),
    which prepares again and must find the cache. `diffusion` and `train` fields add to or replace those of the diffusion and train sections.
    Returns what the tests read: tmp, pipeline, recipe, prepare (None without), train."""
    import yaml

    from finetune.diffusion.tiny import build_tiny_pipeline
    from tests.integration._run import cli_here, train_here

    flags = {} if family == "sd" else {family: True}
    pipeline = build_tiny_pipeline(tmp / f"tiny-{family}", **flags)
    write_color_folder(tmp / "imgs", captions=captions)
    settings = {
        "random_flip": True,
        "validation_inference_steps": 2,
        "validation_prompts": ["a red square"],
        "validation_steps": 3,
        "num_validation_images": 1,
    }
    recipe = diffusion_recipe(tmp, pipeline, tmp / "imgs", **{**settings, **diffusion})
    recipe["data"]["dataloader_drop_last"] = False
    recipe["train"].update(
        {"max_steps": steps, "save_steps": 3, "gradient_accumulation_steps": 2, **(train or {})}
    )
    recipe["lora"]["lora_dropout"] = 0.1
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    prepared = cli_here("prepare-dataset", str(path)) if prepare else None
    trained = train_here(path)
    return {"tmp": tmp, "pipeline": pipeline, "recipe": path, "prepare": prepared, "train": trained}


def assert_prepared_then_reused(trained: dict) -> dict:
    """The CLI's prepare-dataset built the cache of the 8 images and training reused it (the same
    fingerprint); returns the cache's manifest."""
    first, train = trained["prepare"], trained["train"]
    assert first.returncode == 0, first.stderr[-3000:]
    assert "(built)" in first.stdout and "images: 8 in, 8 kept" in first.stdout
    fingerprint = first.stdout.split("prepared dataset ", 1)[1].split()[0]
    assert train.returncode == 0, train.stderr[-3000:]
    assert f"reusing prepared image dataset {fingerprint}" in train.stdout
    line = next(ln for ln in first.stdout.splitlines() if ln.startswith("prepared dataset"))
    return json.loads((Path(line.rsplit(" at ", 1)[1]) / "manifest.json").read_text())
