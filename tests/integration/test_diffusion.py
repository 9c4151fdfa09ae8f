"""Diffusion LoRA end to end through the real CLI, a tiny pipeline per family: prepare and cache hit,
training, checkpoints and exact resume, save, and diffusers' pipeline.load_lora_weights. SD also
DreamBooth with prior preservation and the Hub push; SDXL (two text encoders, pooled embeddings,
size/crop time ids) gradient checkpointing and samples sent to TensorBoard; SD3 and Flux flow matching
(Flux: packed latents with embedded guidance).

The commands run in this process (tests/inprocess.py), no launcher; the module stays in the slow tier
for its length (four families trained and resumed: minutes on 2 cores)."""

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
    dreambooth_recipe,
    prepare_and_train,
)
from tests.integration._run import cli_here, progress, step_losses, train_here

pytestmark = pytest.mark.slow  # long: four pipelines trained and resumed

STEPS = 6
SDXL_STEPS = 4
T5_TOKENS = 24
# Each family's run: prepare_and_train's arguments beyond the shared ones.
RUNS = {
    # 8 images in 3 buckets, prepared twice, 6 steps with Min-SNR, offset noise and EMA.
    "sd": {"steps": STEPS, "snr_gamma": 5.0, "noise_offset": 0.05, "use_ema": True, "ema_decay": 0.9},
    # .txt captions, 4 steps of 2 micro-batches (2 epochs) with gradient checkpointing, checkpoints and 2
    # samples of 2 prompts at steps 2 and 4, to TensorBoard; no separate prepare: training prepares.
    "sdxl": {
        "steps": SDXL_STEPS,
        "prepare": False,
        "captions": "txt",
        "train": {
            "save_steps": 2,
            "gradient_checkpointing": True,
            "report_to": ["tensorboard"],
            "log_steps": 1,
        },
        "center_crop": False,
        "validation_prompts": ["a red square", "a blue square"],
        "validation_steps": 2,
        "num_validation_images": 2,
    },
    "sd3": {
        "steps": STEPS,
        "max_sequence_length": T5_TOKENS,
        "weighting_scheme": "logit_normal",
        "logit_mean": 0.2,
    },
    "flux": {
        "steps": STEPS,
        "max_sequence_length": T5_TOKENS,
        "weighting_scheme": "logit_normal",
        "guidance_scale": 2.0,
        "validation_guidance_scale": 3.5,
    },
}
FLOW_PIPELINES = {"sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict]:
    """trained(family): a tiny pipeline of the family and 8 coloured images of 3 shapes, prepared and
    trained as RUNS says; once per family and module, when a test first asks for it."""
    runs: dict[str, dict] = {}

    def get(family: str) -> dict:
        if family not in runs:
            runs[family] = prepare_and_train(
                tmp_path_factory.mktemp(f"diffusion-{family}"), family, **RUNS[family]
            )
        return runs[family]

    return get


# ------------------------------------------------------------------------------------------------ SD


def test_prepare_then_cache_hit(trained: Callable[[str], dict]) -> None:
    manifest = assert_prepared_then_reused(trained("sd"))
    assert "nothing to encode" in trained("sd")["train"].stdout
    assert len(manifest["buckets"]) == 3 and manifest["latents"]["flipped_variants"] is True


def test_train_saves_a_lora_that_diffusers_loads(trained: Callable[[str], dict]) -> None:
    result, out = trained("sd")["train"], trained("sd")["tmp"] / "out"
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
        trained("sd")["pipeline"], safety_checker=None, requires_safety_checker=False
    )
    assert_lora_changes_generation(pipe, out)


def test_dreambooth_dog_photos_with_prior_preservation(tmp_path: Path, shared_data: Path) -> None:
    dog = shared_data / "dreambooth" / "dog"
    if not dog.is_dir() or not list(dog.glob("*.jpg")):
        pytest.skip(f"the DreamBooth dog photos are not at {dog}")
    from finetune.diffusion.tiny import build_tiny_pipeline

    pipeline = build_tiny_pipeline(tmp_path / "tiny-sd")
    recipe = dreambooth_recipe(
        tmp_path,
        pipeline,
        dog,
        instance_prompt="a photo of sks dog",
        class_prompt="a photo of a dog",
        num_class_images=2,
        validation_guidance_scale=1.0,
    )
    recipe["train"]["max_steps"] = 2
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = train_here(path)
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout + result.stderr
    assert "generating 2 class images" in out and "images: 7 in, 7 kept (5 instance, 2 class)" in out
    assert (tmp_path / "out" / "pytorch_lora_weights.safetensors").is_file()
    assert sorted(step_losses(progress(tmp_path / "out"))) == [1, 2]


def test_hub_push_uploads_the_lora_card_and_samples(trained: Callable[[str], dict], hub_repo_id: str) -> None:
    """hub.model_id: the diffusers-format LoRA, the model card and the sample images it shows go up."""
    from huggingface_hub import HfApi

    sd = trained("sd")
    out = sd["tmp"] / "pushed"
    args = ["--train.max_steps", "1", "--train.save_steps", "0", "--train.output_dir", str(out)]
    result = train_here(sd["recipe"], *args, "--hub.model_id", hub_repo_id)
    assert result.returncode == 0, result.stderr[-4000:]
    files = set(HfApi().list_repo_files(hub_repo_id))
    assert {"pytorch_lora_weights.safetensors", "README.md", "recipe.resolved.yaml"} <= files
    samples = {f for f in files if f.startswith("samples/")}
    assert samples and all(f.endswith(".png") for f in samples)
    card = (out / "README.md").read_text()
    assert all(s.removeprefix("samples/") in card for s in samples)  # the card shows what was pushed
    assert not any(f.startswith("checkpoints/") for f in files)


# ---------------------------------------------------------------------------------------------- SDXL


def test_sdxl_trains_and_saves_a_lora_that_the_sdxl_pipeline_loads(trained: Callable[[str], dict]) -> None:
    sdxl = trained("sdxl")
    result, out = sdxl["train"], sdxl["tmp"] / "out"
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "(StableDiffusionXLPipeline)" in result.stdout and "images: 8 in, 8 kept" in result.stdout
    losses = step_losses(progress(out))
    assert sorted(losses) == list(range(1, SDXL_STEPS + 1)) and all(np.isfinite(list(losses.values())))
    samples = sorted(p.relative_to(out).as_posix() for p in (out / "samples").rglob("*.png"))
    assert len(samples) == 8 and samples[0] == "samples/step-2/00-00-a-red-square.png"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-2", "step-4"]

    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(sdxl["pipeline"])
    assert_lora_changes_generation(pipe, out)
    assert any("lora" in name for name, _ in pipe.unet.named_parameters())


def test_validation_images_and_scalars_reach_tensorboard(trained: Callable[[str], dict]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sdxl = trained("sdxl")
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


# ---------------------------------------------------------------------------------------- SD3 and Flux


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
def test_flow_matching_trains_and_saves_a_lora_that_the_pipeline_loads(
    trained: Callable[[str], dict], family: str
) -> None:
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
    assert f"from diffusers import {FLOW_PIPELINES[family]}" in card
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

    pipe = getattr(diffusers, FLOW_PIPELINES[family]).from_pretrained(trained(family)["pipeline"])
    assert_lora_changes_generation(pipe, out, max_sequence_length=T5_TOKENS, **generation)
    config = pipe.transformer.peft_config[next(iter(pipe.transformer.peft_config))]
    assert (config.r, config.lora_alpha) == (4, 8)  # the recipe's rank and alpha, from the file's metadata


def test_flux_guidance_scale_changes_the_loss(trained: Callable[[str], dict], tmp_path: Path) -> None:
    """The embedded guidance reaches the transformer: the same run with another guidance_scale logs
    another first-step loss (same seed, same draws)."""
    flux = trained("flux")
    out = tmp_path / "other-guidance"
    overrides = ["--train.output_dir", str(out), "--train.max_steps", "1", "--train.save_steps", "0"]
    overrides += ["--diffusion.guidance_scale", "5.0", "--diffusion.validation_prompts", "[]"]
    overrides += ["--diffusion.validation_steps", "null"]
    result = train_here(flux["recipe"], *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    reference = step_losses(progress(flux["tmp"] / "out"))[1]
    assert step_losses(progress(out))[1] != pytest.approx(reference, abs=1e-7)


def test_settings_sd3_cannot_use_are_refused_before_encoding(
    trained: Callable[[str], dict], tmp_path: Path
) -> None:
    result = cli_here(
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


# ----------------------------------------------------------------------------------------- all families


@pytest.mark.parametrize(
    ("family", "from_step", "extra"),
    [("sd", 3, []), ("sdxl", 2, ["--train.report_to", "[]"]), ("sd3", 3, []), ("flux", 3, [])],
    ids=["sd", "sdxl", "sd3", "flux"],
)
def test_resume_from_a_checkpoint_gives_the_same_losses(
    trained: Callable[[str], dict], family: str, from_step: int, extra: list[str]
) -> None:
    """The steps after `from_step` resumed from its checkpoint (LoRA, optimizer, schedule, RNG incl. the
    timestep density's draws, EMA, data position, dropout) equal the uninterrupted run's: shuffle,
    flips, dropout, noise, EMA and accumulation all on (SD), the second epoch (SDXL)."""
    assert_resumes_exactly(trained(family), from_step, *extra)
