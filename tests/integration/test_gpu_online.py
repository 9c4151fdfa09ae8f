"""Online RL on sharded models on CUDA GPUs (skipped without one): GRPO under FSDP2 and ZeRO-3 through
the CLI, generating from the gathered weights, on every GPU there is (2 where 2 are available, else 1).

Run on a GPU machine with `pytest -m gpu tests/integration/test_gpu_online.py`.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.integration._run import REPO, progress, run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GRPO_DEMO = REPO / "recipes" / "demo" / "tiny_grpo_cpu.yaml"


@pytest.mark.parametrize("engine", ["fsdp2", "zero3"])
@pytest.mark.parametrize("generation", ["gather", "layerwise"])
def test_grpo_on_a_sharded_model_trains_and_evaluates(tmp_path, engine, generation):
    gpus = min(torch.cuda.device_count(), 2)
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "finetune.cli", "train", str(GRPO_DEMO), "--accelerate-config", engine,
        "--num-processes", str(gpus), "--lora.enable_lora", "false", "--grpo.sharded_generation", generation,
        "--train.max_steps", "4", "--train.eval_steps", "4", "--train.log_steps", "1",
        "--train.output_dir", str(out), "--data.dataset_prepared_path", str(tmp_path / "prepared"),
    ]  # fmt: skip
    result = run(cmd, unset=("ACCELERATE_USE_CPU",), timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    steps = [r for r in progress(out) if r.get("event") is None and "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["completion_length"] > 0 and "reward" in r for r in steps)
    evals = [r for r in progress(out) if r.get("event") == "eval"]
    assert evals and evals[-1]["eval_prompts"] == 8
