"""Online RL's rollout from a sharded model (finetune.distributed.whole_weights): 2 gloo processes with
torch's FSDP2 sample exactly what one process samples from the whole model, with the weights gathered
whole and layer by layer, and the weights are sharded again afterwards. (Accelerate's FSDP does not start
on CPU: tests/integration/_sharded_generation_worker.py drives torch's fully_shard directly.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import AutoTokenizer

from tests.integration._run import REPO, env

pytestmark = pytest.mark.slow

WORKER = REPO / "tests" / "integration" / "_sharded_generation_worker.py"


def test_fsdp2_rollouts_equal_the_whole_models(tmp_path):
    from finetune.generation.transformers_backend import TransformersBackend
    from tests.integration._sharded_generation_worker import QUESTIONS, lora_model, sample

    tokenizer = AutoTokenizer.from_pretrained(REPO / "recipes" / "demo" / "tokenizer")
    whole = sample(
        TransformersBackend(lora_model(tokenizer), tokenizer), tokenizer, QUESTIONS, list(range(4))
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(WORKER),
    ]
    result = subprocess.run(
        [*cmd, str(tmp_path / "out.pt")], cwd=REPO, env=env(), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    ranks = torch.load(tmp_path / "out.pt")
    for mode in ("gather", "layerwise"):
        sharded = {
            row: completions for r in ranks for row, completions in zip(r["rows"], r[mode], strict=True)
        }
        assert [sharded[row] for row in range(4)] == whole, mode
    # whole inside the gather, still sharded layer by layer, sharded again after
    assert all(r["whole"] == {"gather": True, "layerwise": False} and r["resharded"] for r in ranks)
