"""finetune.engine.checkpoints: resuming unpickles nothing but tensors and plain values. A payload
planted in a checkpoint, its checksums rewritten as anyone who can write the folder (or the Hub repo
hub.strategy every_save pushes to) could, never runs; the diffusion EMA is extra state (safetensors
and JSON) and resumes exactly."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator

from finetune.checkpoint import write_checksums
from finetune.engine.checkpoints import checkpoint, resume, tensors_only_loads
from finetune.engine.extra_state import JSON_FILE
from finetune.engine.state import LoopState
from finetune.errors import FinetuneError
from finetune.objectives.diffusion import DiffusionObjective


def _plant_marker(path: str) -> None:
    Path(path).write_text("the payload ran")


class Payload:
    """Unpickled without weights_only, it calls _plant_marker: what a real payload does with os.system."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (_plant_marker, (str(self.marker),))


def _plant(folder: Path, name: str, marker: Path) -> None:
    torch.save(Payload(marker), folder / name)
    write_checksums(folder)  # the checksums rewritten to match: the checkpoint verifies


def _ema_objective(accelerator, model) -> tuple[DiffusionObjective, dict]:
    """The diffusion objective's EMA on `model` (built as after accelerator.prepare), and the extra
    state it returns for checkpoints."""
    objective = DiffusionObjective.__new__(DiffusionObjective)  # no pipeline: only the EMA is used
    objective.settings = SimpleNamespace(use_ema=True, ema_decay=0.9)
    objective.train = SimpleNamespace(seed=0, enable_full_determinism=False)
    objective.ema = None
    return objective, objective.on_prepared(accelerator, model) or {}


def _run(accelerator, model, out: Path, extra_state: dict) -> SimpleNamespace:
    """The engine's run with what checkpoint() and resume() read."""
    train = SimpleNamespace(load_checkpoint_path="auto", save_total_limit=None, extend_run=False)
    return SimpleNamespace(
        accelerator=accelerator,
        model=model,
        output_dir=out,
        train=train,
        hub=SimpleNamespace(model_id=None),
        recipe_dict={"train": {"lr": 0.1}},
        extra_state=extra_state,
        state=LoopState(),
        total_steps=4,
        resumed_at=None,
    )


@pytest.fixture
def prepared(fresh_accelerator_state):
    acc = Accelerator(cpu=True, mixed_precision="no")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    return acc, model


def _update(objective, model, k: int) -> None:
    """A deterministic weight change and the EMA step that follows every applied update."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * k)
    objective.after_update(model)


def test_the_diffusion_ema_is_checkpointed_without_pickle_and_resumes_exactly(tmp_path, prepared):
    acc, model = prepared
    objective, extra = _ema_objective(acc, model)
    assert set(extra) == {"ema"} and acc._custom_objects == []  # nothing for accelerate to pickle
    run = _run(acc, model, tmp_path, extra)
    for k in (1, 2):
        _update(objective, model, k)
    run.state.step = 2
    path = checkpoint(run)
    assert not list(path.glob("custom_checkpoint_*")) and "ema" in json.loads((path / JSON_FILE).read_text())
    for k in (3, 4):
        _update(objective, model, k)
    uninterrupted = [p.clone() for p in objective.ema.shadow_params]

    with torch.no_grad():  # a new process: other weights and a fresh EMA until the checkpoint loads
        for p in model.parameters():
            p.zero_()
    again, extra = _ema_objective(acc, model)
    resumed = _run(acc, model, tmp_path, extra)
    resume(resumed)
    assert resumed.state.step == 2 and again.ema.optimization_step == 2
    for k in (3, 4):
        _update(again, model, k)
    assert again.ema.optimization_step == objective.ema.optimization_step
    for got, want in zip(again.ema.shadow_params, uninterrupted, strict=True):
        assert torch.equal(got, want)


def test_a_pickle_planted_beside_a_diffusion_ema_checkpoint_never_runs(tmp_path, prepared):
    """accelerate would unpickle custom_checkpoint_0.pkl with weights_only=False for an object given to
    register_for_checkpointing (as the EMA once was): the file is refused unread."""
    acc, model = prepared
    objective, extra = _ema_objective(acc, model)
    run = _run(acc, model, tmp_path, extra)
    _update(objective, model, 1)
    run.state.step = 1
    path = checkpoint(run)
    marker = tmp_path / "payload-ran"
    _plant(path, "custom_checkpoint_0.pkl", marker)
    with pytest.raises(FinetuneError, match=rf"{path} holds custom_checkpoint_0.pkl: pickled state"):
        resume(_run(acc, model, tmp_path, _ema_objective(acc, model)[1]))
    assert not marker.exists()


def test_a_pickle_planted_in_a_file_accelerate_loads_is_refused_and_never_runs(tmp_path, prepared):
    acc, model = prepared
    run = _run(acc, model, tmp_path, {})
    run.state.step = 1
    path = checkpoint(run)
    marker = tmp_path / "payload-ran"
    _plant(path, "optimizer.bin", marker)
    with pytest.raises(FinetuneError, match=rf"{path}: a file in it holds objects other than tensors"):
        resume(_run(acc, model, tmp_path, {}))
    assert not marker.exists()


def test_loads_that_ask_for_full_unpickling_are_tensors_only_while_resuming(tmp_path):
    """DeepSpeed loads its checkpoint files with torch.load(weights_only=False): during a resume that
    is overridden (torch's TORCH_FORCE_WEIGHTS_ONLY_LOAD), and a payload is refused unrun."""
    marker = tmp_path / "payload-ran"
    torch.save(Payload(marker), tmp_path / "mp_rank_00_model_states.pt")
    torch.save({"step": torch.tensor(3), "ds_version": "0.19"}, tmp_path / "plain.pt")
    with tensors_only_loads(tmp_path):
        assert torch.load(tmp_path / "plain.pt", weights_only=False)["ds_version"] == "0.19"
    refused = pytest.raises(FinetuneError, match="not loaded, since unpickling it could run code")
    with refused, tensors_only_loads(tmp_path):
        torch.load(tmp_path / "mp_rank_00_model_states.pt", weights_only=False)
    assert not marker.exists() and "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ
