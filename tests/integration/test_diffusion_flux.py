"""Flux LoRA end to end through the real CLI: prepare, cache hit, packed flow-matching training with
embedded guidance, checkpoint and exact resume, save, and diffusers' FluxPipeline.load_lora_weights."""

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
from tests.integration._run import accelerate_cmd, progress, run, step_losses

pytestmark = pytest.mark.slow

STEPS = 6
T5_TOKENS = 24


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny Flux pipeline, 8 coloured images of 3 shapes, prepared, then trained for STEPS steps."""
    return prepare_and_train(
        tmp_path_factory.mktemp("diffusion-flux"),
        "flux",
        steps=STEPS,
        max_sequence_length=T5_TOKENS,
        weighting_scheme="logit_normal",
        guidance_scale=2.0,
        validation_guidance_scale=3.5,
    )


def test_prepare_caches_clip_and_t5_and_is_reused(trained: dict) -> None:
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
    assert manifest["pipeline"]["family"] == "flux"
    assert manifest["fingerprint_inputs"]["text"] == {"max_sequence_length": T5_TOKENS}
    assert manifest["latents"]["shift_factor"] == pytest.approx(0.1159)
    assert [p["subfolder"] for p in manifest["fingerprint_inputs"]["text_encoders"]][:2] == [
        "text_encoder",
        "text_encoder_2",
    ]


def test_train_saves_a_lora_that_flux_loads(trained: dict) -> None:
    result, out = trained["train"], trained["tmp"] / "out"
    assert result.returncode == 0, result.stderr[-4000:]
    assert "transformer LoRA:" in result.stdout and "FluxPipeline" in result.stdout
    losses = step_losses(progress(out))
    assert sorted(losses) == list(range(1, STEPS + 1)) and all(np.isfinite(list(losses.values())))
    samples = sorted(p.relative_to(out).as_posix() for p in (out / "samples").rglob("*.png"))
    assert samples == ["samples/step-3/00-00-a-red-square.png", "samples/step-6/00-00-a-red-square.png"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-3", "step-6"]
    card = (out / "README.md").read_text()
    assert "from diffusers import FluxPipeline" in card
    assert "| objective | flow matching, weighting_scheme logit_normal |" in card
    resolved = yaml.safe_load((out / "recipe.resolved.yaml").read_text())
    assert resolved["diffusion"]["guidance_scale"] == 2.0

    from diffusers import FluxPipeline
    from safetensors.torch import load_file

    keys = list(load_file(str(out / "pytorch_lora_weights.safetensors")))
    assert keys and all(k.startswith("transformer.") for k in keys)
    assert any(".attn.add_k_proj." in k for k in keys)
    assert any(k.startswith("transformer.single_transformer_blocks.0.attn.to_q.") for k in keys)

    pipe = FluxPipeline.from_pretrained(trained["pipeline"])
    assert_lora_changes_generation(pipe, out, max_sequence_length=T5_TOKENS, guidance_scale=3.5)
    config = pipe.transformer.peft_config[next(iter(pipe.transformer.peft_config))]
    assert (config.r, config.lora_alpha) == (4, 8)  # the recipe's rank and alpha, from the file's metadata


def test_resume_from_a_checkpoint_gives_the_same_losses(trained: dict) -> None:
    """Steps 4-6 resumed from step 3 (LoRA, optimizer, schedule, RNG, data position, dropout) equal
    the uninterrupted run's."""
    assert_resumes_exactly(trained, 3)


def test_guidance_scale_changes_the_loss(trained: dict, tmp_path: Path) -> None:
    """The embedded guidance reaches the transformer: the same run with another guidance_scale logs
    another first-step loss (same seed, same draws)."""
    out = tmp_path / "other-guidance"
    overrides = ["--train.output_dir", str(out), "--train.max_steps", "1", "--train.save_steps", "0"]
    overrides += ["--diffusion.guidance_scale", "5.0", "--diffusion.validation_prompts", "[]"]
    overrides += ["--diffusion.validation_steps", "null"]
    result = run(accelerate_cmd(trained["recipe"], *overrides), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    reference = step_losses(progress(trained["tmp"] / "out"))[1]
    assert step_losses(progress(out))[1] != pytest.approx(reference, abs=1e-7)
