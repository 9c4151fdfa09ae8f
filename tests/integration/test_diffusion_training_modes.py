"""What trains besides the denoiser's LoRA, end to end on tiny pipelines: LoRA on the CLIP text
encoder(s) (SD, SDXL, Flux), LoKr and LoHa adapters through PEFT, and full fine-tuning of the denoiser
with EMA. Each run trains, resumes exactly from its checkpoint, and what it saved loads where a user
loads it (diffusers' load_lora_weights, PEFT's PeftModel, the pipeline folder) and changes the image.

In this process (tests/inprocess.py); slow for its length (six tiny pipelines trained and resumed).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.diffusion_data import assert_resumes_exactly, prepare_and_train
from tests.integration._run import progress, step_losses, train_here

pytestmark = pytest.mark.slow  # long: six tiny pipelines trained and resumed

STEPS = 4  # checkpoints at step 3 (prepare_and_train), resumed from there
T5 = {"max_sequence_length": 24}
RUNS = {
    "te-sd": ("sd", {"train_text_encoder": True, "text_encoder_lr": 5e-4}),
    "te-sdxl": ("sdxl", {"train_text_encoder": True}),
    "te-flux": ("flux", {"train_text_encoder": True, "text_encoder_lr": 5e-4, **T5}),
    "lokr": ("sd", {"adapter": "lokr"}),
    "loha": ("sd", {"adapter": "loha"}),
    "full": ("sd", {"adapter": "full", "use_ema": True, "ema_decay": 0.5}),
}
PIPELINES = {"sd": "StableDiffusionPipeline", "sdxl": "StableDiffusionXLPipeline", "flux": "FluxPipeline"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict]:
    """trained(name): RUNS[name] trained STEPS steps on 8 coloured images (once per module)."""
    runs: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in runs:
            family, settings = RUNS[name]
            # Full fine-tuning: a smaller lr for every weight (the recipe's LoRA sizes only warn).
            train = {"lr": 1e-3 if settings.get("adapter") == "full" else 5e-3}
            run = prepare_and_train(
                tmp_path_factory.mktemp(name), family, steps=STEPS, prepare=False, train=train, **settings
            )
            assert run["train"].returncode == 0, run["train"].stderr[-4000:]
            runs[name] = run
        return runs[name]

    return get


def _pipeline(family: str, folder: Path):
    import diffusers

    cls = getattr(diffusers, PIPELINES[family])
    extra = {"safety_checker": None, "requires_safety_checker": False} if family == "sd" else {}
    pipe = cls.from_pretrained(str(folder), **extra)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _generate(pipe, family: str) -> np.ndarray:
    extra = {"max_sequence_length": 24} if family == "flux" else {}
    return pipe(
        "a red square",
        num_inference_steps=2,
        height=32,
        width=32,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
        **extra,
    ).images


def _clip_output(pipe, family: str) -> torch.Tensor:
    """The first CLIP encoder's output on a caption: the pooled output for Flux (what it uses), else the
    last hidden state."""
    ids = pipe.tokenizer(
        ["a red square"],
        padding="max_length",
        max_length=pipe.tokenizer.model_max_length,
        return_tensors="pt",
    ).input_ids
    with torch.no_grad():
        out = pipe.text_encoder(ids)
    return out.pooler_output if family == "flux" else out[0]


# -------------------------------------------------------------------------------------- text encoders


@pytest.mark.parametrize("name", ["te-sd", "te-sdxl", "te-flux"])
def test_text_encoder_lora_loads_in_diffusers_and_changes_the_encoder_and_image(
    trained: Callable[[str], dict], name: str
) -> None:
    run, family = trained(name), RUNS[name][0]
    out = run["tmp"] / "out"
    stdout = run["train"].stdout
    assert "text_encoder LoRA:" in stdout and ("text_encoder_2 LoRA:" in stdout) == (family == "sdxl")
    saved = load_file(out / "pytorch_lora_weights.safetensors")
    prefixes = {key.split(".", 1)[0] for key in saved}
    want = {"sd": {"unet", "text_encoder"}, "sdxl": {"unet", "text_encoder", "text_encoder_2"}}
    assert prefixes == want.get(family, {"transformer", "text_encoder"})  # Flux: CLIP only, T5 frozen
    pipe = _pipeline(family, run["pipeline"])
    encoder_before, image_before = _clip_output(pipe, family), _generate(pipe, family)
    pipe.load_lora_weights(out)
    encoder_after, image_after = _clip_output(pipe, family), _generate(pipe, family)
    assert (encoder_after - encoder_before).abs().max() > 1e-4
    assert np.isfinite(image_after).all() and np.abs(image_after - image_before).max() > 1e-4


@pytest.mark.parametrize("name", ["te-sd", "te-sdxl", "te-flux"])
def test_text_encoder_lora_resumes_exactly(trained: Callable[[str], dict], name: str) -> None:
    """Losses after step 3 and the saved LoRA (denoiser and text encoders) equal the uninterrupted run's."""
    extra = ["--train.report_to", "[]"] if name == "te-sdxl" else []
    assert_resumes_exactly(trained(name), 3, *extra)


def test_text_encoder_lr_is_its_own_group(trained: Callable[[str], dict]) -> None:
    """The optimizer state of the checkpoint holds the text encoders' group at diffusion.text_encoder_lr's
    schedule: its LR over the denoiser's is 5e-4 / 5e-3 at every step."""
    checkpoint = trained("te-sd")["tmp"] / "out" / "checkpoints" / "step-3"
    state = torch.load(checkpoint / "optimizer.bin", weights_only=True)
    lrs = sorted({group["lr"] for group in state["param_groups"]})
    assert len(lrs) == 2 and lrs[0] / lrs[1] == pytest.approx(0.1)


# ---------------------------------------------------------------------------------------- LoKr / LoHa


@pytest.mark.parametrize(("name", "layer"), [("lokr", "LoKr"), ("loha", "LoHa")])
def test_lokr_and_loha_load_with_peft_and_change_the_image(
    trained: Callable[[str], dict], name: str, layer: str
) -> None:
    from peft import PeftModel

    run = trained(name)
    folder = run["tmp"] / "out" / "unet"
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not (run["tmp"] / "out" / "pytorch_lora_weights.safetensors").exists()
    pipe = _pipeline("sd", run["pipeline"])
    before = _generate(pipe, "sd")
    pipe.unet = PeftModel.from_pretrained(pipe.unet, str(folder))  # what docs/diffusion.md tells users
    kinds = {type(m).__name__ for m in pipe.unet.modules()}
    assert f"{layer}Layer" not in kinds and "Linear" in kinds  # PEFT's LoKr / LoHa Linear layers
    assert any(f"peft.tuners.{name}" in type(m).__module__ for m in pipe.unet.modules())
    after = _generate(pipe, "sd")
    assert np.isfinite(after).all() and np.abs(after - before).max() > 1e-4


@pytest.mark.parametrize("name", ["lokr", "loha"])
def test_lokr_and_loha_resume_exactly(trained: Callable[[str], dict], name: str) -> None:
    _assert_resumes(trained(name), lambda out: load_file(out / "unet" / "adapter_model.safetensors"))


# ---------------------------------------------------------------------------------------- full + EMA


def test_full_finetune_with_ema_saves_a_pipeline_that_diffusers_loads(trained: Callable[[str], dict]) -> None:
    run = trained("full")
    out = run["tmp"] / "out"
    assert "unet full fine-tuning: 792,964 trainable / 792,964 total parameters" in run["train"].stdout
    assert (out / "checkpoints" / "step-3" / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    base, tuned = _pipeline("sd", run["pipeline"]), _pipeline("sd", out / "pipeline")
    before, after = _generate(base, "sd"), _generate(tuned, "sd")
    assert np.isfinite(after).all() and np.abs(after - before).max() > 1e-4
    # The checkpoint holds diffusers' EMA shadow (one tensor per UNet weight) beside the trained UNet,
    # and they differ: the final save (the EMA, checked by the resume test) is not the trained weights.
    step3 = out / "checkpoints" / "step-3"
    shadow = [v for k, v in load_file(step3 / "extra_state.safetensors").items() if "shadow" in k]
    weights = load_file(step3 / "unet" / "diffusion_pytorch_model.safetensors")
    assert len(shadow) == len(weights)
    assert sum(t.numel() for t in shadow) == sum(t.numel() for t in weights.values()) == 792_964
    trained_flat = torch.cat([p.flatten() for p in _in_parameter_order(run["pipeline"], weights)])
    assert (torch.cat([t.flatten() for t in shadow]) - trained_flat).abs().max() > 1e-6


def test_full_finetune_with_ema_resumes_exactly(trained: Callable[[str], dict]) -> None:
    """The resumed run (UNet weights, optimizer, EMA shadow from the checkpoint) saves the same EMA UNet."""
    _assert_resumes(
        trained("full"),
        lambda out: load_file(out / "pipeline" / "unet" / "diffusion_pytorch_model.safetensors"),
    )


def _in_parameter_order(pipeline: Path, weights: dict) -> list[torch.Tensor]:
    """`weights` in the UNet's parameter order (EMAModel's shadow order)."""
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(pipeline, subfolder="unet")
    return [weights[name] for name, _ in unet.named_parameters()]


def _assert_resumes(run: dict, saved: Callable[[Path], dict]) -> None:
    tmp = run["tmp"]
    checkpoint = tmp / "out" / "checkpoints" / "step-3"
    resumed = train_here(
        run["recipe"],
        "--train.output_dir", str(tmp / "resumed"), "--train.load_checkpoint_path", str(checkpoint),
        "--diffusion.validation_prompts", "[]", "--diffusion.validation_steps", "null",
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    reference, after = step_losses(progress(tmp / "out")), step_losses(progress(tmp / "resumed"))
    assert sorted(after) == [4]
    assert after[4] == pytest.approx(reference[4], abs=1e-6)
    want, got = saved(tmp / "out"), saved(tmp / "resumed")
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        torch.testing.assert_close(got[key], tensor, rtol=0, atol=1e-6, msg=key)
