"""EVA and CorDA (lora.init_lora_weights) through the real CLI on the tiny demo: the init is computed
once from the training data and saved; a run resumed from a checkpoint (into another output_dir)
loads it instead of reading the data and continues with the same losses; the final adapter loads on
the base; 2 gloo processes compute it once and train. CorDA shares this code (finetune.model.lora_init); its
weights are checked against PEFT's in tests/unit/model/test_lora_init.py, and its conversion to plain LoRA
(with modules_to_save kept) in tests/unit/model/test_lora_variants.py, without a CLI run of its own.

One-process runs go through the CLI's main in this process (tests/inprocess.py); the 2-process run is
real (slow tier)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.integration._run import DEMO, cli_here, progress, run, short_run, step_losses

# A small rank and few batches keep EVA's incremental SVD and CorDA's covariance short on 2 cores.
INIT = [
    "--lora.lora_rank",
    "4",
    "--lora.lora_alpha",
    "8",
    "--train.max_steps",
    "4",
    "--train.save_steps",
    "2",
]
COMPUTED = "the init is computed from the training data"
LOADED = "not computed again"


@pytest.fixture(scope="module")
def prepared(demo_prepared):
    """The session's prepared demo data (tests/conftest.py)."""
    return demo_prepared


def _train(out: Path, prepared: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = ["train", str(DEMO), *short_run(), *INIT, *args]
    cmd += ["--train.output_dir", str(out), "--data.dataset_prepared_path", str(prepared)]
    multi_process = "--accelerate-config" in args  # torchrun: subprocesses, the rest in this process
    result = run([sys.executable, "-m", "finetune.cli", *cmd]) if multi_process else cli_here(*cmd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def _loads_on_the_base(out: Path) -> dict:
    """The final adapter loads on the run's base (output_dir/base_model) and changes its outputs."""
    base = AutoModelForCausalLM.from_pretrained(out / "base_model")
    ids = torch.randint(4, 704, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = base(input_ids=ids).logits
        after = PeftModel.from_pretrained(base, out).eval()(input_ids=ids).logits
    assert torch.isfinite(after).all() and not torch.allclose(before, after)
    return json.loads((out / "adapter_config.json").read_text())


@pytest.mark.parametrize(
    ("init", "extra"),
    [
        ("eva", ["--lora.eva.num_batches", "4", "--lora.eva.tau", "0.9"]),
    ],
)
def test_trains_and_a_resume_loads_the_saved_init(tmp_path, prepared, init, extra):
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    result = _train(first, prepared, "--lora.init_lora_weights", init, *extra)
    assert result.stdout.count(COMPUTED) == 1, result.stdout[-2000:]
    losses = step_losses(progress(first))
    assert sorted(losses) == [1, 2, 3, 4] and all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    checkpoint = first / "checkpoints" / "step-2"
    result = _train(
        resumed,
        prepared,
        "--lora.init_lora_weights",
        init,
        *extra,
        "--train.load_checkpoint_path",
        str(checkpoint),
    )
    assert COMPUTED not in result.stdout and LOADED in result.stdout, result.stdout[-2000:]
    assert str(first / "lora_init") in result.stdout
    later = step_losses(progress(resumed))
    assert {k: later[k] for k in (3, 4)} == pytest.approx({k: losses[k] for k in (3, 4)}, rel=1e-6, abs=1e-7)
    config = _loads_on_the_base(first)
    # EVA's ranks, redistributed across layers, are recorded for loading.
    assert config["init_lora_weights"] == "eva" and config["rank_pattern"]


@pytest.mark.slow  # two processes (torchrun)
def test_two_processes_compute_eva_once_and_train(tmp_path, prepared):
    out = tmp_path / "ddp"
    result = _train(
        out, prepared, "--lora.init_lora_weights", "eva", "--lora.eva.num_batches", "4", "--lora.eva.tau", "0.9",
        "--accelerate-config", "multi_cpu", "--train.micro_batch_size", "2",
    )  # fmt: skip
    assert result.stdout.count(COMPUTED) == 1, result.stdout[-2000:]
    assert sorted(step_losses(progress(out))) == [1, 2, 3, 4]
    _loads_on_the_base(out)
