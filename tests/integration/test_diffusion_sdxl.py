"""SDXL LoRA end to end through the real CLI on a tiny SDXL pipeline (two text encoders, pooled
embeddings, size/crop time ids): train with gradient checkpointing, validation samples sent to
TensorBoard, checkpoint and exact resume, a LoRA that StableDiffusionXLPipeline loads."""

from __future__ import annotations

import numpy as np
import pytest

from tests.diffusion_data import (
    assert_lora_changes_generation,
    assert_resumes_exactly,
    prepare_and_train,
)
from tests.integration._run import progress, step_losses

pytestmark = pytest.mark.slow

STEPS = 4


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """8 coloured images in 3 buckets (.txt captions), 4 steps of 2 micro-batches (2 epochs) with
    gradient checkpointing, checkpoints and 2 samples of 2 prompts at steps 2 and 4, to TensorBoard;
    no separate prepare: training prepares."""
    return prepare_and_train(
        tmp_path_factory.mktemp("sdxl"),
        "sdxl",
        steps=STEPS,
        prepare=False,
        captions="txt",
        train={"save_steps": 2, "gradient_checkpointing": True, "report_to": ["tensorboard"], "log_steps": 1},
        timeout=300,
        center_crop=False,
        validation_prompts=["a red square", "a blue square"],
        validation_steps=2,
        num_validation_images=2,
    )


def test_sdxl_trains_and_saves_a_lora_that_the_sdxl_pipeline_loads(sdxl: dict) -> None:
    result, out = sdxl["train"], sdxl["tmp"] / "out"
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "(StableDiffusionXLPipeline)" in result.stdout and "images: 8 in, 8 kept" in result.stdout
    losses = step_losses(progress(out))
    assert sorted(losses) == list(range(1, STEPS + 1)) and all(np.isfinite(list(losses.values())))
    samples = sorted(p.relative_to(out).as_posix() for p in (out / "samples").rglob("*.png"))
    assert len(samples) == 8 and samples[0] == "samples/step-2/00-00-a-red-square.png"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-2", "step-4"]

    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(sdxl["pipeline"])
    assert_lora_changes_generation(pipe, out)
    assert any("lora" in name for name, _ in pipe.unet.named_parameters())


def test_sdxl_resume_from_a_checkpoint_gives_the_same_losses(sdxl: dict) -> None:
    """Steps 3-4 (the second epoch) resumed from step 2 equal the uninterrupted run's."""
    assert_resumes_exactly(sdxl, 2, "--train.report_to", "[]")


def test_validation_images_and_scalars_reach_tensorboard(sdxl: dict) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert sdxl["train"].returncode == 0
    out = sdxl["tmp"] / "out"
    images: dict[str, list] = {}
    scalars: dict[str, list] = {}
    event_files = sorted(out.rglob("events.out.tfevents.*"))
    assert event_files, f"no TensorBoard event files under {out}"
    for path in event_files:
        events = EventAccumulator(str(path), size_guidance={"images": 0, "scalars": 0})
        events.Reload()
        for tag in events.Tags()["images"]:
            images.setdefault(tag, []).extend(events.Images(tag))
        for tag in events.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend(events.Scalars(tag))
    # One image summary per prompt and validation step: the 2 samples of a prompt side by side (NHWC grid).
    assert sorted(images) == ["validation/00", "validation/01"]
    for tag, entries in images.items():
        assert sorted(e.step for e in entries) == [2, 4], tag
        assert all(e.height == 32 and e.width >= 64 and e.encoded_image_string for e in entries), tag
    # The logged scalars are the progress log's values.
    losses = step_losses(progress(out))
    assert {e.step: e.value for e in scalars["loss"]} == pytest.approx(losses, abs=1e-6)
    assert {"lr", "grad_norm", "images_per_sec", "num_images"} <= scalars.keys()
    assert [e.value for e in sorted(scalars["num_images"], key=lambda e: e.step)] == [4, 8, 12, 16]
