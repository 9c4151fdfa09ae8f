"""Diffusion LoRA end to end through the real CLI: prepare, cache hit, train, save, load, resume, DreamBooth."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.diffusion_data import (
    assert_lora_changes_generation,
    assert_prepared_then_reused,
    assert_resumes_exactly,
    diffusion_recipe,
    prepare_and_train,
)
from tests.integration._run import accelerate_cmd, progress, run, step_losses

pytestmark = pytest.mark.slow

STEPS = 6


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny SD pipeline, 8 coloured images of 3 shapes, prepared twice and trained for STEPS steps."""
    return prepare_and_train(
        tmp_path_factory.mktemp("diffusion"),
        "sd",
        steps=STEPS,
        snr_gamma=5.0,
        noise_offset=0.05,
        use_ema=True,
        ema_decay=0.9,
    )


def test_prepare_then_cache_hit(trained: dict) -> None:
    manifest = assert_prepared_then_reused(trained)
    assert "nothing to encode" in trained["train"].stdout
    assert len(manifest["buckets"]) == 3 and manifest["latents"]["flipped_variants"] is True


def test_train_saves_a_lora_that_diffusers_loads(trained: dict) -> None:
    result, out = trained["train"], trained["tmp"] / "out"
    assert result.returncode == 0, result.stderr[-4000:]
    losses = step_losses(progress(out))
    assert sorted(losses) == list(range(1, STEPS + 1)) and all(np.isfinite(list(losses.values())))
    records = [r for r in progress(out) if r.get("event") is None]
    assert all(r["images_per_sec"] > 0 for r in records)
    samples = sorted(p.relative_to(out).as_posix() for p in (out / "samples").rglob("*.png"))
    assert samples == ["samples/step-3/00-00-a-red-square.png", "samples/step-6/00-00-a-red-square.png"]
    card = (out / "README.md").read_text()
    assert (
        "![a red square](samples/step-6/00-00-a-red-square.png)" in card and "library_name: diffusers" in card
    )
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-3", "step-6"]
    assert not list((out / "checkpoints").rglob("model*.safetensors"))  # LoRA-only checkpoints

    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(
        trained["pipeline"], safety_checker=None, requires_safety_checker=False
    )
    assert_lora_changes_generation(pipe, out)


def test_resume_from_a_checkpoint_gives_the_same_losses(trained: dict) -> None:
    """Steps 4-6 resumed from the step-3 checkpoint (LoRA, optimizer, schedule, RNG, EMA, data position)
    equal the uninterrupted run's (shuffle, flips, dropout, noise, EMA and accumulation all on)."""
    assert_resumes_exactly(trained, 3)


def test_dreambooth_dog_photos_with_prior_preservation(tmp_path: Path, shared_data: Path) -> None:
    dog = shared_data / "dreambooth" / "dog"
    if not dog.is_dir() or not list(dog.glob("*.jpg")):
        pytest.skip(f"the DreamBooth dog photos are not at {dog}")
    from finetune.diffusion.tiny import build_tiny_pipeline

    pipeline = build_tiny_pipeline(tmp_path / "tiny-sd")
    recipe = diffusion_recipe(
        tmp_path,
        pipeline,
        dog,
        type_="dreambooth",
        instance_prompt="a photo of sks dog",
        with_prior_preservation=True,
        class_data_dir=str(tmp_path / "class"),
        class_prompt="a photo of a dog",
        num_class_images=2,
        class_generation_steps=1,
        validation_guidance_scale=1.0,
    )
    recipe["train"]["max_steps"] = 2
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = run(accelerate_cmd(path))
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout + result.stderr
    assert "generating 2 class images" in out and "images: 7 in, 7 kept (5 instance, 2 class)" in out
    assert (tmp_path / "out" / "pytorch_lora_weights.safetensors").is_file()
    assert sorted(step_losses(progress(tmp_path / "out"))) == [1, 2]


def test_hub_push_uploads_the_lora_card_and_samples(trained: dict, hub_repo_id: str) -> None:
    """hub.model_id: the diffusers-format LoRA, the model card and the sample images it shows go up."""
    from huggingface_hub import HfApi

    out = trained["tmp"] / "pushed"
    args = ["--train.max_steps", "1", "--train.save_steps", "0", "--train.output_dir", str(out)]
    result = run(accelerate_cmd(trained["recipe"], *args, "--hub.model_id", hub_repo_id))
    assert result.returncode == 0, result.stderr[-4000:]
    files = set(HfApi().list_repo_files(hub_repo_id))
    assert {"pytorch_lora_weights.safetensors", "README.md", "recipe.resolved.yaml"} <= files
    samples = {f for f in files if f.startswith("samples/")}
    assert samples and all(f.endswith(".png") for f in samples)
    card = (out / "README.md").read_text()
    assert all(s.removeprefix("samples/") in card for s in samples)  # the card shows what was pushed
    assert not any(f.startswith("checkpoints/") for f in files)
