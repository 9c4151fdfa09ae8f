"""causal_lm_loss under DeepSpeed ZeRO-3 (one CPU process through `accelerate launch`): the head's weight
is partitioned and gathered only inside the head's own call, which is where the swapped forward reads it.
Three SGD steps (lr 1, so a wrong gradient shows in the next losses) match the model's own loss."""

from __future__ import annotations

import json
import sys

import pytest

from tests.integration._run import REPO, run

pytestmark = pytest.mark.slow


def test_zero3_losses_match_the_models_own_loss():
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
        "--use_deepspeed", "--zero_stage", "3", "--mixed_precision", "no",
        "--main_process_port", "0",  # a free port: not 29500, which a parallel run may hold
        str(REPO / "tests" / "integration" / "_chunked_ce_zero3.py"),
    ]  # fmt: skip
    # DeepSpeed picks its CPU accelerator itself; ACCELERATE_USE_CPU would turn the engine off.
    result = run(cmd, unset=("ACCELERATE_USE_CPU",), quiet=False)  # its own script, not a finetune entry
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT "))
    losses = json.loads(line.removeprefix("RESULT "))
    for kind in ("full", "lora"):
        assert losses[f"{kind}-chunked"] == pytest.approx(losses[f"{kind}-model"], rel=1e-5)
        assert losses[f"{kind}-model"][2] < losses[f"{kind}-model"][0]  # the steps did train
