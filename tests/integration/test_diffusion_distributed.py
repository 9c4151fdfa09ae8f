"""Diffusion LoRA on 2 CPU processes (`finetune train --accelerate-config multi_cpu`: torchrun, gloo DDP):
one process prepares while the other waits on the patient barrier, both ranks train the same number of
steps on their own images (each image once per epoch), and the LoRA is saved once."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml

from tests.diffusion_data import diffusion_recipe, write_color_folder
from tests.integration._run import REPO, env, progress, step_losses

pytestmark = pytest.mark.slow


def test_two_processes_train_each_image_once_per_epoch_and_save_once(tmp_path) -> None:
    from finetune.diffusion.tiny import build_tiny_pipeline

    pipeline = build_tiny_pipeline(tmp_path / "tiny-sd")
    write_color_folder(tmp_path / "imgs", count=7)
    recipe = diffusion_recipe(
        tmp_path,
        pipeline,
        tmp_path / "imgs",
        random_flip=True,
        validation_prompts=["a red square"],
        num_validation_images=1,
        validation_inference_steps=1,
    )
    recipe["data"]["dataloader_drop_last"] = False
    # Buckets of 3, 2 and 2 images, micro batch 2 on each of 2 processes: 3 global batches per epoch
    # (3 = 2 + 1, 2 = 1 + 1, 2 = 1 + 1). Accelerate's BatchSamplerShard over the 4 single-process
    # batches (2 + 1, 2, 2) would skip every round whose last batch is short (images lost in some
    # epochs), and even out an odd number of batches by repeating some.
    recipe["train"].update(max_steps=3, save_steps=3, log_steps=1)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = subprocess.run(
        [sys.executable, "-m", "finetune.cli", "train", str(path), "--accelerate-config", "multi_cpu"],
        cwd=REPO,
        env={**env(), "OMP_NUM_THREADS": "1"},  # one thread per rank: two ranks share two cores
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "buckets: 24x44: 2, 32x32: 3, 44x24: 2" in output
    assert output.count("(built)") == 1  # one process encoded, the other read its cache

    per_process = {
        int(m[0]): (int(m[1]), int(m[2]), int(m[3]))
        for m in re.findall(r"process (\d): (\d+) steps, (\d+) micro-batches, (\d+) images", output)
    }
    assert sorted(per_process) == [0, 1], output[-3000:]
    (steps0, micro0, images0), (steps1, micro1, images1) = per_process[0], per_process[1]
    assert steps0 == steps1 == 3 and micro0 == micro1 == 3
    assert images0 + images1 == 7  # one epoch: every image exactly once, none repeated

    out = tmp_path / "out"
    records = [r for r in progress(out) if r.get("event") is None]
    assert sorted(step_losses(records)) == [1, 2, 3]
    assert records[-1]["num_images"] == 7 and records[-1]["epoch"] == 1.0
    assert output.count("LoRA weights saved:") == 1
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    assert sorted(p.name for p in (out / "samples" / "step-3").iterdir()) == ["00-00-a-red-square.png"]
    checkpoint = out / "checkpoints" / "step-3"
    assert (checkpoint / "rng_state_0.json").is_file() and (checkpoint / "rng_state_1.json").is_file()
