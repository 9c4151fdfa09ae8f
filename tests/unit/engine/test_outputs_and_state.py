"""The engine's progress records (throughput without eval/save time), the progress log of a fresh or
resumed run, extra checkpointed state without pickle, Hub pushes that fail, weights that are not finite."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from finetune.engine.checkpoints import check_finite_weights, push_checkpoint
from finetune.engine.extra_state import load_extra, save_extra
from finetune.engine.loop import start_progress_log
from finetune.engine.outputs import log_step
from finetune.engine.state import LoopState
from finetune.errors import FinetuneError
from tests.fakes import fake_run


class _Log:
    def __init__(self):
        self.records = []

    def log(self, record):
        self.records.append(record)


def test_evaluation_and_checkpoint_time_is_left_out_of_throughput():
    seen = {}

    class Objective:
        def log_fields(self, interval, elapsed, totals):
            seen.update(interval=dict(interval), elapsed=elapsed)
            return {"tokens_per_sec": interval["tokens"] / elapsed}

    run, log = fake_run(Objective(), train_loader=[0] * 10), _Log()
    interval = {"t0": time.perf_counter() - 10.0, "paused": 9.0, "tokens": 100}
    log_step(run, {"loss": 1.0, "lr": 0.1}, interval, log)
    assert seen["elapsed"] == pytest.approx(1.0, abs=0.05)  # 10 s of which 9 s evaluating or saving
    assert seen["interval"] == {"tokens": 100}  # t0 and paused are not counts
    assert log.records[0]["tokens_per_sec"] == pytest.approx(100, rel=0.05)
    assert set(interval) == {"t0"}  # the next interval starts clean


def test_progress_log_of_a_resumed_run_ends_at_its_checkpoint(tmp_path: Path):
    path = tmp_path / "progress.jsonl"
    lines = [{"step": s, "loss": 1.0} for s in range(1, 7)] + [{"step": 4, "event": "eval"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 7, "lo')  # cut by a crash
    said = []
    start_progress_log(path, resumed_at=4, say=said.append)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 4, 4]
    assert records[-1] == {"step": 4, "event": "resumed"}
    assert said == ["progress.jsonl: 3 record(s) after step 4 removed; they are replayed from the checkpoint"]


def test_a_fresh_run_keeps_the_previous_log_aside(tmp_path: Path):
    path = tmp_path / "progress.jsonl"
    for n in (1, 2):
        path.write_text(json.dumps({"step": n}) + "\n")
        start_progress_log(path, resumed_at=None, say=lambda _: None)
    assert not path.exists()
    assert json.loads((tmp_path / "progress.2.jsonl").read_text()) == {"step": 2}


def test_extra_state_round_trips_without_pickle(tmp_path: Path):
    class Holder:
        def __init__(self, state):
            self.state = state

        def state_dict(self):
            return self.state

        def load_state_dict(self, state):
            self.state = state

    ema = Holder({"decay": 0.99, "step": 3, "shadow_params": [torch.arange(3.0), torch.ones(2, 2)]})
    save_extra({"ema": ema}, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["extra_state.json", "extra_state.safetensors"]
    restored = Holder(None)
    load_extra({"ema": restored}, tmp_path)
    assert restored.state["decay"] == 0.99 and restored.state["step"] == 3
    torch.testing.assert_close(restored.state["shadow_params"][0], torch.arange(3.0))
    with pytest.raises(FinetuneError, match=r"has no extra_state\.json"):
        load_extra({"ema": restored}, tmp_path / "missing")


def test_a_failing_hub_push_is_retried_then_a_warning(monkeypatch, tmp_path: Path):
    import finetune.hub

    calls = []

    def push_folder(*args, **kwargs):
        calls.append(args)
        raise ConnectionError("the Hub is down")

    monkeypatch.setattr(finetune.hub, "push_folder", push_folder)
    said = []
    run = SimpleNamespace(
        hub=SimpleNamespace(model_id="org/run", private=True),
        state=LoopState(step=5),
        accelerator=SimpleNamespace(print=said.append),
    )
    assert push_checkpoint(run, tmp_path / "step-5", attempts=3, wait_s=0) is False
    assert len(calls) == 3
    assert said[0].startswith("warning: hub.strategy every_save: pushing step-5 to org/run failed 3 times")


def test_weights_that_are_not_finite_are_never_written():
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    run = SimpleNamespace(model=model)
    with pytest.raises(
        FinetuneError, match=r"not writing the final model: 1 trained tensor\(s\) hold inf or NaN"
    ):
        check_finite_weights(run, "the final model")
    model.weight.requires_grad_(False)  # frozen tensors are not checked
    check_finite_weights(run, "the final model")


def _resolved(tmp_path: Path, recipe: dict) -> Path:
    import yaml

    folder = tmp_path / "step-3"
    folder.mkdir()
    (folder / "recipe.resolved.yaml").write_text(yaml.safe_dump(recipe))
    return folder


def test_resume_refuses_trajectory_changes_and_names_each_one(tmp_path):
    from finetune.engine.checkpoints import check_resumable

    saved = {"train": {"lr": 1e-4, "max_steps": 8, "log_steps": 1}, "diffusion": {"snr_gamma": 5.0}}
    folder = _resolved(tmp_path, saved)
    now = {"train": {"lr": 2e-4, "max_steps": 8, "log_steps": 1}, "diffusion": {"snr_gamma": None}}
    with pytest.raises(FinetuneError) as err:
        check_resumable(folder, now)
    assert "train.lr: 0.0001 in the checkpoint, 0.0002 now" in str(err.value)
    assert "diffusion.snr_gamma: 5.0 in the checkpoint, None now" in str(err.value)


def test_resume_allows_changes_to_what_is_only_reported(tmp_path):
    from finetune.engine.checkpoints import check_resumable

    saved = {
        "train": {"lr": 1e-4, "log_steps": 1, "eval_steps": 2, "save_steps": 3},
        "diffusion": {"snr_gamma": 5.0, "validation_prompts": ["a red square"], "validation_steps": 3},
    }
    now = {
        "train": {"lr": 1e-4, "log_steps": 5, "eval_steps": None, "save_steps": 10},
        "diffusion": {"snr_gamma": 5.0, "validation_prompts": [], "validation_steps": None},
    }
    check_resumable(_resolved(tmp_path, saved), now)  # no error
