"""The LLM loop on one CUDA GPU (skipped without one): fp16 with dynamic loss scaling (trains, logs
the scale, skips and counts overflowing steps, resumes with the scaler's state to the same losses within
1e-3 relative), bf16, and
Liger kernels against the plain loss.

Run on a GPU machine with `pytest -m gpu tests/integration/test_gpu_train.py`.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from tests.integration._run import DEMO, progress, run, short_run, step_losses

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

COMMON = short_run("--train.max_steps", "8", "--train.save_steps", "4")


def train(out: Path, prepared: Path, *args: str) -> None:
    cmd = [sys.executable, "-m", "finetune.cli", "train", str(DEMO), "--accelerate-config", "single_gpu"]
    cmd += [*COMMON, *args, "--train.output_dir", str(out), "--data.dataset_prepared_path", str(prepared)]
    result = run(cmd, unset=("ACCELERATE_USE_CPU",))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


def train_records(out: Path) -> list[dict]:
    return [r for r in progress(out) if r.get("event") is None and r.get("loss") is not None]


def test_fp16_loss_scaling_trains_logs_the_scale_and_resumes_within_1e3(tmp_path):
    """LoRA on an fp16 base (torch_dtype auto) with the demo's modules_to_save, which must train in fp32
    for the scaler; the scale and the skipped-step count are logged; a resume restores the scaler (the
    loss scales equal) and gives the later losses to 1e-3 relative, not exactly: fp16 carries about
    3 significant digits (its epsilon is 9.8e-4) and CUDA kernels are not bitwise reproducible."""
    prepared, out = tmp_path / "prepared", tmp_path / "run"
    args = ["--train.mixed_precision", "fp16", "--model.torch_dtype", "auto"]
    train(out, prepared, *args)
    records = train_records(out)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert all(r["loss_scale"] and r["loss_scale"] > 0 for r in records)
    assert all(isinstance(r["fp16_skipped_steps"], int) for r in records)
    assert all(math.isfinite(r["loss"]) for r in records)
    assert records[-1]["loss"] < records[0]["loss"]

    resumed = tmp_path / "resumed"
    train(resumed, prepared, *args, "--train.load_checkpoint_path", str(out / "checkpoints" / "step-4"))
    before, after = step_losses(progress(out)), step_losses(progress(resumed))
    assert sorted(after) == [5, 6, 7, 8]
    for step in after:
        assert after[step] == pytest.approx(before[step], rel=1e-3), (step, before, after)
    scales = {r["step"]: r["loss_scale"] for r in train_records(out)}
    assert {r["step"]: r["loss_scale"] for r in train_records(resumed)} == {s: scales[s] for s in after}


def test_fp16_overflow_skips_the_update_and_counts_it(tmp_path, monkeypatch, fresh_accelerator_state):
    """An infinite gradient under fp16: GradScaler skips the step (weights unchanged), the loop
    counts it, the scale halves; the next finite step updates the weights."""
    from finetune import engine
    from finetune.engine.loop import setup
    from finetune.engine.step import train_step
    from finetune.objectives import objective_for
    from finetune.recipe import load_recipe, recipe_to_dict

    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    recipe = load_recipe(
        str(DEMO),
        [
            *COMMON,
            "--train.mixed_precision",
            "fp16",
            "--train.output_dir",
            str(tmp_path / "run"),
            "--data.dataset_prepared_path",
            str(tmp_path / "prepared"),
        ],
    )
    accelerator = engine.make_accelerator(recipe.train, model_kind="llm", qlora=False, compile_model=False)
    run_ = setup(
        objective_for(recipe),
        accelerator,
        train=recipe.train,
        hub=recipe.hub,
        recipe_dict=recipe_to_dict(recipe),
    )
    lora = next(p for n, p in run_.model.named_parameters() if p.requires_grad and "lora_B" in n)
    batches = iter(run_.train_loader)
    scale = run_.accelerator.scaler.get_scale()
    before = lora.detach().clone()
    hook = lora.register_hook(lambda grad: torch.full_like(grad, float("inf")))
    result = train_step(run_, [next(batches)])
    hook.remove()
    assert result["applied"] and result["fp16_skipped"]  # the loss was finite: the scaler skipped
    assert torch.equal(lora.detach(), before)
    assert run_.accelerator.scaler.get_scale() == scale / 2
    result = train_step(run_, [next(batches)])
    assert result["applied"] and not result["fp16_skipped"]
    assert not torch.equal(lora.detach(), before)


def test_bf16_full_fine_tune_on_gpu_logs_throughput_and_mfu_fields(tmp_path):
    prepared, out = tmp_path / "prepared", tmp_path / "run"
    train(
        out,
        prepared,
        "--train.mixed_precision",
        "bf16",
        "--lora.enable_lora",
        "false",
        "--lora.modules_to_save",
        "[]",
        "--train.lr",
        "1e-3",
    )
    records = train_records(out)
    assert records[-1]["loss"] < records[0]["loss"]
    assert all(r["peak_mem_gib"] > 0 and r["tokens_per_sec"] > 0 for r in records)
    name = torch.cuda.get_device_name()
    if any(key in name for key in ("H100", "H200", "A100")):
        assert all(r["mfu"] is not None and 0 < r["mfu"] < 1 for r in records)


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel is not installed")
def test_liger_kernels_follow_the_plain_loss(tmp_path):
    """Liger's fused RMSNorm/RoPE/SwiGLU/linear-cross-entropy give the same token-normalised losses as
    the plain model, step for step (bf16 rounding apart)."""
    prepared = tmp_path / "prepared"
    args = ["--train.mixed_precision", "bf16", "--train.save_steps", "0"]
    train(tmp_path / "plain", prepared, *args)
    train(tmp_path / "liger", prepared, *args, "--model.enable_liger_kernel", "true")
    plain, liger = step_losses(progress(tmp_path / "plain")), step_losses(progress(tmp_path / "liger"))
    assert sorted(liger) == sorted(plain) == list(range(1, 9))
    for step in plain:
        assert liger[step] == pytest.approx(plain[step], rel=2e-2), (step, plain, liger)
