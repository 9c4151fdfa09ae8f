"""Stable Diffusion 3 LoRA end to end through the real CLI: prepare, cache hit, flow-matching training,
checkpoint and exact resume, save, and diffusers' StableDiffusion3Pipeline.load_lora_weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.diffusion_data import (
    assert_lora_changes_generation,
    assert_resumes_exactly,
    prepare_and_train,
)
from tests.integration._run import cli, progress, step_losses

pytestmark = pytest.mark.slow

STEPS = 6
T5_TOKENS = 24


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny SD3 pipeline, 8 coloured images of 3 shapes, prepared, then trained for STEPS steps."""
    return prepare_and_train(
        tmp_path_factory.mktemp("diffusion-sd3"),
        "sd3",
        steps=STEPS,
        max_sequence_length=T5_TOKENS,
        weighting_scheme="logit_normal",
        logit_mean=0.2,
    )


def test_prepare_caches_the_three_text_encoders_and_is_reused(trained: dict) -> None:
    first, train = trained["prepare"], trained["train"]
    assert first.returncode == 0, first.stderr[-3000:]
    assert "(built)" in first.stdout and "images: 8 in, 8 kept" in first.stdout
    fingerprint = first.stdout.split("prepared dataset ", 1)[1].split()[0]
    assert train.returncode == 0, train.stderr[-3000:]
    assert f"reusing prepared image dataset {fingerprint}" in train.stdout
    folder = Path(
        next(ln for ln in first.stdout.splitlines() if ln.startswith("prepared dataset")).rsplit(" at ", 1)[1]
    )
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["pipeline"]["family"] == "sd3"
    assert manifest["fingerprint_inputs"]["text"] == {"max_sequence_length": T5_TOKENS}
    assert manifest["latents"]["shift_factor"] == pytest.approx(0.0609)
    assert [p["subfolder"] for p in manifest["fingerprint_inputs"]["text_encoders"]][:3] == [
        "text_encoder",
        "text_encoder_2",
        "text_encoder_3",
    ]


def test_train_saves_a_lora_that_stable_diffusion_3_loads(trained: dict) -> None:
    result, out = trained["train"], trained["tmp"] / "out"
    assert result.returncode == 0, result.stderr[-4000:]
    assert "transformer LoRA:" in result.stdout
    losses = step_losses(progress(out))
    assert sorted(losses) == list(range(1, STEPS + 1)) and all(np.isfinite(list(losses.values())))
    samples = sorted(p.relative_to(out).as_posix() for p in (out / "samples").rglob("*.png"))
    assert samples == ["samples/step-3/00-00-a-red-square.png", "samples/step-6/00-00-a-red-square.png"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-3", "step-6"]
    card = (out / "README.md").read_text()
    assert "from diffusers import StableDiffusion3Pipeline" in card
    assert "| objective | flow matching, weighting_scheme logit_normal |" in card
    resolved = yaml.safe_load((out / "recipe.resolved.yaml").read_text())
    assert "add_k_proj" in resolved["lora"]["lora_target_modules"]

    from diffusers import StableDiffusion3Pipeline
    from safetensors.torch import load_file

    keys = list(load_file(str(out / "pytorch_lora_weights.safetensors")))
    assert keys and all(k.startswith("transformer.transformer_blocks.") for k in keys)
    assert any(".attn.add_k_proj." in k for k in keys) and any(".attn.to_k." in k for k in keys)

    pipe = StableDiffusion3Pipeline.from_pretrained(trained["pipeline"])
    assert_lora_changes_generation(pipe, out, max_sequence_length=T5_TOKENS)
    config = pipe.transformer.peft_config[next(iter(pipe.transformer.peft_config))]
    assert (config.r, config.lora_alpha) == (4, 8)  # the recipe's rank and alpha, from the file's metadata


def test_resume_from_a_checkpoint_gives_the_same_losses(trained: dict) -> None:
    """Steps 4-6 resumed from step 3 (LoRA, optimizer, schedule, RNG incl. the timestep density's
    draws, data position, dropout) equal the uninterrupted run's."""
    assert_resumes_exactly(trained, 3)


def test_settings_sd3_cannot_use_are_refused_before_encoding(trained: dict, tmp_path: Path) -> None:
    result = cli(
        "prepare-dataset",
        str(trained["recipe"]),
        "--diffusion.snr_gamma",
        "5.0",
        "--data.dataset_prepared_path",
        str(tmp_path / "prepared"),
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "diffusion.snr_gamma: Min-SNR weighting is for epsilon / v-prediction UNets" in result.stderr
    assert not (tmp_path / "prepared").exists()
