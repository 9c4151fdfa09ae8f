"""SD3 and Flux LoRA end to end through the real CLI (the flow-matching transformer families, a tiny
pipeline each): prepare, cache hit, flow-matching training (Flux: packed latents with embedded
guidance), checkpoint and exact resume, save, and diffusers' pipeline.load_lora_weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.diffusion_data import (
    assert_lora_changes_generation,
    assert_prepared_then_reused,
    assert_resumes_exactly,
    prepare_and_train,
)
from tests.integration._run import accelerate_cmd, cli, progress, run, step_losses

pytestmark = pytest.mark.slow

STEPS = 6
T5_TOKENS = 24
# Each family's diffusion settings beyond the shared run of prepare_and_train, and its pipeline class.
SETTINGS = {
    "sd3": {"weighting_scheme": "logit_normal", "logit_mean": 0.2},
    "flux": {"weighting_scheme": "logit_normal", "guidance_scale": 2.0, "validation_guidance_scale": 3.5},
}
PIPELINES = {"sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict]:
    """trained(family): a tiny pipeline of the family, 8 coloured images of 3 shapes, prepared, then
    trained for STEPS steps; once per family and module, when a test first asks for it."""
    runs: dict[str, dict] = {}

    def get(family: str) -> dict:
        if family not in runs:
            tmp = tmp_path_factory.mktemp(f"diffusion-{family}")
            runs[family] = prepare_and_train(
                tmp, family, steps=STEPS, max_sequence_length=T5_TOKENS, **SETTINGS[family]
            )
        return runs[family]

    return get


@pytest.mark.parametrize(
    ("family", "text_encoders", "shift_factor"),
    [
        ("sd3", ["text_encoder", "text_encoder_2", "text_encoder_3"], 0.0609),  # CLIP-L, CLIP-G, T5
        ("flux", ["text_encoder", "text_encoder_2"], 0.1159),  # CLIP, T5
    ],
    ids=["sd3", "flux"],
)
def test_prepare_caches_the_text_encoders_and_is_reused(
    trained: Callable[[str], dict], family: str, text_encoders: list[str], shift_factor: float
) -> None:
    manifest = assert_prepared_then_reused(trained(family))
    assert manifest["pipeline"]["family"] == family
    assert manifest["fingerprint_inputs"]["text"] == {"max_sequence_length": T5_TOKENS}
    assert manifest["latents"]["shift_factor"] == pytest.approx(shift_factor)
    subfolders = [p["subfolder"] for p in manifest["fingerprint_inputs"]["text_encoders"]]
    assert subfolders[: len(text_encoders)] == text_encoders


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_train_saves_a_lora_that_the_pipeline_loads(trained: Callable[[str], dict], family: str) -> None:
    import diffusers
    from safetensors.torch import load_file

    result, out = trained(family)["train"], trained(family)["tmp"] / "out"
    assert result.returncode == 0, result.stderr[-4000:]
    assert "transformer LoRA:" in result.stdout
    losses = step_losses(progress(out))
    assert sorted(losses) == list(range(1, STEPS + 1)) and all(np.isfinite(list(losses.values())))
    samples = sorted(p.relative_to(out).as_posix() for p in (out / "samples").rglob("*.png"))
    assert samples == ["samples/step-3/00-00-a-red-square.png", "samples/step-6/00-00-a-red-square.png"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-3", "step-6"]
    card = (out / "README.md").read_text()
    assert f"from diffusers import {PIPELINES[family]}" in card
    assert "| objective | flow matching, weighting_scheme logit_normal |" in card
    resolved = yaml.safe_load((out / "recipe.resolved.yaml").read_text())
    keys = list(load_file(str(out / "pytorch_lora_weights.safetensors")))
    if family == "sd3":
        assert "add_k_proj" in resolved["lora"]["lora_target_modules"]
        assert keys and all(k.startswith("transformer.transformer_blocks.") for k in keys)
        assert any(".attn.add_k_proj." in k for k in keys) and any(".attn.to_k." in k for k in keys)
        generation = {}
    else:  # flux: dual-stream and single-stream blocks, embedded guidance
        assert "FluxPipeline" in result.stdout
        assert resolved["diffusion"]["guidance_scale"] == 2.0
        assert keys and all(k.startswith("transformer.") for k in keys)
        assert any(".attn.add_k_proj." in k for k in keys)
        assert any(k.startswith("transformer.single_transformer_blocks.0.attn.to_q.") for k in keys)
        generation = {"guidance_scale": 3.5}

    pipe = getattr(diffusers, PIPELINES[family]).from_pretrained(trained(family)["pipeline"])
    assert_lora_changes_generation(pipe, out, max_sequence_length=T5_TOKENS, **generation)
    config = pipe.transformer.peft_config[next(iter(pipe.transformer.peft_config))]
    assert (config.r, config.lora_alpha) == (4, 8)  # the recipe's rank and alpha, from the file's metadata


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_resume_from_a_checkpoint_gives_the_same_losses(trained: Callable[[str], dict], family: str) -> None:
    """Steps 4-6 resumed from step 3 (LoRA, optimizer, schedule, RNG incl. the timestep density's
    draws, data position, dropout) equal the uninterrupted run's."""
    assert_resumes_exactly(trained(family), 3)


def test_flux_guidance_scale_changes_the_loss(trained: Callable[[str], dict], tmp_path: Path) -> None:
    """The embedded guidance reaches the transformer: the same run with another guidance_scale logs
    another first-step loss (same seed, same draws)."""
    flux = trained("flux")
    out = tmp_path / "other-guidance"
    overrides = ["--train.output_dir", str(out), "--train.max_steps", "1", "--train.save_steps", "0"]
    overrides += ["--diffusion.guidance_scale", "5.0", "--diffusion.validation_prompts", "[]"]
    overrides += ["--diffusion.validation_steps", "null"]
    result = run(accelerate_cmd(flux["recipe"], *overrides), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    reference = step_losses(progress(flux["tmp"] / "out"))[1]
    assert step_losses(progress(out))[1] != pytest.approx(reference, abs=1e-7)


def test_settings_sd3_cannot_use_are_refused_before_encoding(
    trained: Callable[[str], dict], tmp_path: Path
) -> None:
    result = cli(
        "prepare-dataset",
        str(trained("sd3")["recipe"]),
        "--diffusion.snr_gamma",
        "5.0",
        "--data.dataset_prepared_path",
        str(tmp_path / "prepared"),
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "diffusion.snr_gamma: Min-SNR weighting is for epsilon / v-prediction UNets" in result.stderr
    assert not (tmp_path / "prepared").exists()
