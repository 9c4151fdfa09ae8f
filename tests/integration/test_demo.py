"""The embedded demo, end to end through `accelerate launch finetune/train.py` (issue: demo)."""

from __future__ import annotations

import json

import pytest
from peft import PeftConfig

from tests.integration._run import DEMO, accelerate_cmd, demo_overrides, progress, run, step_losses

pytestmark = pytest.mark.slow


def test_demo_trains_and_writes_outputs(tmp_path):
    result = run(accelerate_cmd(DEMO, *demo_overrides(tmp_path, "--train.log_format", "structured")))
    assert result.returncode == 0, result.stderr[-4000:]
    out = tmp_path / "out"
    records = progress(out)
    losses = step_losses(records)
    steps = sorted(losses)
    assert len(steps) >= 5
    for record in records:
        if record.get("event") is None:
            assert {"step", "loss", "lr", "tokens_per_sec", "grad_norm"} <= record.keys()
            assert record["tokens_per_sec"] > 0
    first, last = losses[steps[0]], losses[steps[-1]]
    assert last < first - 1.0, f"loss did not fall: {first} -> {last}"
    evals = [r for r in records if r.get("event") == "eval"]
    assert evals and evals[-1]["eval_loss"] < first
    for name in (
        "recipe.resolved.yaml",
        "adapter_model.safetensors",
        "adapter_config.json",
        "tokenizer.json",
        "README.md",
    ):
        assert (out / name).is_file(), name
    config = PeftConfig.from_pretrained(out)
    assert (out / "base_model" / "config.json").is_file()
    # The final files and the random-init base are recorded: eval, chat and merge-lora verify them.
    record = json.loads((out / "checksums.json").read_text())
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= set(record)
    assert "README.md" not in record and "progress.jsonl" not in record
    assert "model.safetensors" in json.loads((out / "base_model" / "checksums.json").read_text())
    assert config.base_model_name_or_path == str((out / "base_model").resolve())
    manifest = json.loads(next((tmp_path / "prepared").glob("*/manifest.json")).read_text())
    assert manifest["rows_out"]["train"] > 0
    assert "loss" in result.stdout
