"""Diffusion LoRA on one CUDA GPU (skipped without one): fp16 with dynamic loss scaling and bf16
train a tiny SD pipeline end to end through the CLI, and the saved LoRA loads into diffusers.

Run on a GPU machine with `pytest -m gpu tests/integration/test_gpu_diffusion.py`.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.diffusion_data import assert_lora_changes_generation, diffusion_recipe, write_color_folder
from tests.integration._run import progress, run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def pipeline_and_images(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from finetune.diffusion.tiny import build_tiny_pipeline

    tmp = tmp_path_factory.mktemp("gpu-diffusion")
    pipeline = build_tiny_pipeline(tmp / "tiny-sd")
    write_color_folder(tmp / "imgs", captions="jsonl")
    return pipeline, tmp / "imgs"


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_diffusion_lora_trains_in_16_bit_on_gpu(tmp_path, pipeline_and_images, precision):
    from diffusers import StableDiffusionPipeline

    pipeline, images = pipeline_and_images
    recipe = diffusion_recipe(tmp_path, pipeline, images)
    recipe["train"].update(mixed_precision=precision, max_steps=6, save_steps=3)
    recipe["data"]["dataloader_drop_last"] = False
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    cmd = [sys.executable, "-m", "finetune.cli", "train", str(path), "--accelerate-config", "single_gpu"]
    result = run(cmd, unset=("ACCELERATE_USE_CPU",))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    records = [r for r in progress(tmp_path / "out") if r.get("event") is None and r.get("loss") is not None]
    assert [r["step"] for r in records] == list(range(1, 7))
    assert all(math.isfinite(r["loss"]) for r in records)
    if precision == "fp16":
        assert all(r["loss_scale"] and r["loss_scale"] > 0 for r in records)
        assert all(isinstance(r["fp16_skipped_steps"], int) for r in records)
    else:
        assert all(r["loss_scale"] is None for r in records)
    pipe = StableDiffusionPipeline.from_pretrained(
        pipeline, safety_checker=None, requires_safety_checker=False
    )
    assert_lora_changes_generation(pipe, tmp_path / "out")
