"""finetune.engine.loop.save_final: the final outputs are recorded in checksums.json (what finetune
verifies when it loads them), and a full disk is a clear error."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from safetensors import SafetensorError
from safetensors.torch import save_file

from finetune.checkpoint import verify_checksums
from finetune.engine.loop import save_final
from finetune.engine.state import LoopState
from finetune.errors import WriteError


class _Objective:
    """Saves an adapter, its config and a model card, as the LM objectives do; or fails as a full disk."""

    def __init__(self, out: Path, failure: Exception | None = None):
        self.out, self.failure = out, failure

    def save(self, model, metrics) -> list[Path]:
        save_file({"w": model.weight.detach().contiguous()}, str(self.out / "adapter_model.safetensors"))
        if self.failure is not None:
            raise self.failure
        (self.out / "adapter_config.json").write_text('{"r": 4}')
        (self.out / "README.md").write_text("# card\n")
        return []


class _ModeRecorder:
    """An optimizer's train()/eval() (schedule-free ones have them), recorded."""

    def __init__(self):
        self.modes: list[str] = []

    def train(self):
        self.modes.append("train")

    def eval(self):
        self.modes.append("eval")


def _run(out: Path, objective) -> SimpleNamespace:
    return SimpleNamespace(
        accelerator=Accelerator(cpu=True),
        model=torch.nn.Linear(3, 2),
        optimizer=_ModeRecorder(),
        objective=objective,
        output_dir=out,
        state=LoopState(step=4),
        hub=SimpleNamespace(model_id=None),
    )


def test_the_final_save_records_the_files_it_wrote(tmp_path, fresh_accelerator_state):
    (tmp_path / "progress.jsonl").write_text("{}\n")  # written by the loop, appended to by a resume
    (tmp_path / "eval.json").write_text("{}\n")  # an earlier `finetune eval`, rewritten by the next
    run = _run(tmp_path, _Objective(tmp_path))
    save_final(run, {"step": 4})
    assert run.optimizer.modes == ["eval"]  # a schedule-free optimizer saves its evaluation weights
    record = json.loads((tmp_path / "checksums.json").read_text())
    # The model card is left out (people edit it; nothing loads it), as is what the save did not write.
    assert sorted(record) == ["adapter_config.json", "adapter_model.safetensors"]
    assert verify_checksums(tmp_path) is None


def test_a_full_disk_in_the_final_save_is_a_clear_error(tmp_path, fresh_accelerator_state):
    full = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    with pytest.raises(WriteError) as caught:
        save_final(_run(tmp_path, _Objective(tmp_path, full)), {"step": 4})
    message = str(caught.value)
    assert message.startswith(f"saving the final model in {tmp_path}: no space left on the device")
    assert "MiB free on that disk" in message and "checkpoints" in message
    assert "resume with --train.load_checkpoint_path auto" in message
    assert not (tmp_path / "checksums.json").exists()
