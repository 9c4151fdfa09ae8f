"""finetune.engine.lifecycle: the output_dir lock, a finished run left alone, an extended run's schedule;
and check_resumable's one accepted change, a longer run asked for with train.extend_run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from finetune.engine.checkpoints import check_resumable
from finetune.engine.lifecycle import (
    extend_schedule,
    finished_message,
    hold_output_dir,
    last_record,
    mark_finished,
)
from finetune.engine.state import LoopState
from finetune.errors import FinetuneError
from finetune.optim import build_scheduler


def _main_process(said: list) -> SimpleNamespace:
    return SimpleNamespace(is_main_process=True, num_processes=1, print=said.append)


def test_a_second_holder_of_an_output_dir_gets_an_error_naming_the_first(tmp_path: Path):
    out, said = tmp_path / "out", []
    with hold_output_dir(_main_process(said), out):
        with pytest.raises(FinetuneError) as err, hold_output_dir(_main_process(said), out):
            pass
        message = str(err.value)
        assert message.startswith(
            f"train.output_dir {out} is in use by another training run (pid {os.getpid()} on host "
        )
        assert "choose another train.output_dir" in message
    with hold_output_dir(_main_process(said), out):  # released at the end of the block
        pass
    assert said == []  # nothing was taken over


def test_a_lock_record_left_behind_is_taken_over_with_a_note(tmp_path: Path):
    out, said = tmp_path / "out", []
    out.mkdir()
    left = {"pid": 999999, "host": "node7", "started": "2025-01-01 10:00:00 +0000"}
    (out / ".train.owner.json").write_text(json.dumps(left))
    with hold_output_dir(_main_process(said), out):
        pass
    assert said == [
        f"note: {out} was locked by a run that ended without releasing it (pid 999999 on host node7, "
        "started 2025-01-01 10:00:00 +0000; killed?): taking the lock over"
    ]


# ------------------------------------------------------------------------------------ finished runs


def _finished_run(tmp_path: Path, recipe: dict, *, step: int = 4) -> Path:
    out = tmp_path / "out"
    checkpoint = out / "checkpoints" / f"step-{step}"
    checkpoint.mkdir(parents=True)
    (checkpoint / "recipe.resolved.yaml").write_text(yaml.safe_dump(recipe))
    (checkpoint / "train_state.json").write_text(json.dumps({"state": {"step": step}, "total_steps": step}))
    (out / "checkpoints" / "latest").write_text(f"step-{step}\n")
    (out / "progress.jsonl").write_text(json.dumps({"step": step, "loss": 1.0}) + "\n")
    mark_finished(out, step)
    return out


RECIPE = {"train": {"lr": 1e-3, "max_steps": 4, "log_steps": 1}, "hub": {"model_id": None}}


def test_resuming_a_finished_run_is_recognised(tmp_path: Path):
    out = _finished_run(tmp_path, RECIPE)
    message = finished_message(out, "auto", RECIPE)
    assert message.startswith(f"{out} holds a finished run: all 4 steps trained")
    assert "nothing written" in message and "--train.extend_run true" in message
    # A setting that is only reported may change; the path of the last checkpoint works as `auto` does.
    relogged = {**RECIPE, "train": {**RECIPE["train"], "log_steps": 5}}
    assert finished_message(out, str(out / "checkpoints" / "step-4"), relogged) == message


def test_what_is_not_a_finished_run_resumes(tmp_path: Path):
    out = _finished_run(tmp_path, RECIPE)
    longer = {**RECIPE, "train": {**RECIPE["train"], "max_steps": 8}}
    assert finished_message(out, "auto", longer) is None  # an extension (or a change resume refuses)
    assert finished_message(out, None, RECIPE) is None  # not a resume
    earlier = out / "checkpoints" / "step-2"
    earlier.mkdir()
    (earlier / "train_state.json").write_text(json.dumps({"state": {"step": 2}}))
    assert finished_message(out, str(earlier), RECIPE) is None  # an earlier checkpoint, on purpose
    with open(out / "progress.jsonl", "a") as f:
        f.write(json.dumps({"step": 5, "loss": 1.0}) + "\n")  # a run that went on after it
    assert finished_message(out, "auto", RECIPE) is None


def test_a_finished_run_whose_final_push_failed_says_how_to_push_it(tmp_path: Path):
    recipe = {**RECIPE, "hub": {"model_id": "me/run", "private": True}}
    out = _finished_run(tmp_path, recipe)
    (out / "hub-upload").mkdir()
    assert f"push it with: hf upload me/run {out / 'hub-upload'} . --private." in finished_message(
        out, "auto", recipe
    )


def test_last_record_reads_the_end_of_a_long_log(tmp_path: Path):
    path = tmp_path / "progress.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in range(1, 5000)))
    assert last_record(path) == {"step": 4999, "loss": 0.5}
    with open(path, "a") as f:
        f.write('{"step": 5000, "lo')  # cut short by a crash
    assert last_record(path) == {}
    assert last_record(tmp_path / "absent.jsonl") == {}


# ------------------------------------------------------------------------------------ extended runs


def _trained(total_steps: int, steps: int, style: str):
    """(optimizer, scheduler) of a run planned for `total_steps`, after `steps` updates."""
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=1e-2)
    scheduler = build_scheduler(
        optimizer, style=style, num_warmup_steps=int(0.25 * total_steps), num_training_steps=total_steps,
        lr=1e-2, lr_min=1e-4,
    )  # fmt: skip
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    return optimizer, scheduler


@pytest.mark.parametrize("style", ["cosine", "linear"])
def test_an_extended_schedule_goes_on_as_a_run_planned_that_long(style):
    """A checkpoint of a finished 4-step run, loaded into a run planned for 12 steps and extended: from
    the current step on, the LR is that of a run started with 12 steps."""
    old_optimizer, old_scheduler = _trained(4, 4, style)
    optimizer, scheduler = _trained(12, 0, style)
    optimizer.load_state_dict(old_optimizer.state_dict())  # what accelerate's load_state does
    scheduler.load_state_dict(old_scheduler.state_dict())
    reference_optimizer, reference = _trained(12, 4, style)
    assert optimizer.param_groups[0]["lr"] != pytest.approx(reference_optimizer.param_groups[0]["lr"])
    said = []
    run = SimpleNamespace(
        scheduler=scheduler,
        state=LoopState(step=4),
        total_steps=12,
        train=SimpleNamespace(lr_warmup_ratio=0.25, lr_decay_style=style),
        accelerator=SimpleNamespace(print=said.append),
        extension=None,
    )
    extend_schedule(run, 4)
    assert run.extension == {
        "step": 4, "event": "extended", "from_total_steps": 4, "to_total_steps": 12,
        "lr": pytest.approx(reference_optimizer.param_groups[0]["lr"]),
    }  # fmt: skip
    for _ in range(8):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(reference_optimizer.param_groups[0]["lr"])
        optimizer.step(), scheduler.step()
        reference_optimizer.step(), reference.step()
    assert run.state.extensions == [{"step": 4, "from_total_steps": 4, "to_total_steps": 12}]
    assert said[0].startswith(
        "warning: train.extend_run: the run goes on from step 4 to 12 (it had 4 steps); the LR schedule is "
        f"rebuilt for 12 steps (3 warmup, {style} to lr_min at step 12) and continues at step 4: the LR goes from "
    )


def _checkpoint(tmp_path: Path, recipe: dict, total_steps: int) -> Path:
    folder = tmp_path / "step-4"
    folder.mkdir()
    (folder / "recipe.resolved.yaml").write_text(yaml.safe_dump(recipe))
    (folder / "train_state.json").write_text(json.dumps({"state": {"step": 4}, "total_steps": total_steps}))
    return folder


def test_a_longer_run_is_refused_with_the_flag_named_and_accepted_with_it(tmp_path: Path):
    folder = _checkpoint(tmp_path, {"train": {"lr": 1e-3, "max_steps": 4}}, total_steps=4)
    longer = {"train": {"lr": 1e-3, "max_steps": 8}}
    with pytest.raises(FinetuneError) as err:
        check_resumable(folder, longer, total_steps=8)
    assert "train.max_steps: 4 in the checkpoint, 8 now" in str(err.value)
    assert "add --train.extend_run true" in str(err.value)
    assert check_resumable(folder, longer, total_steps=8, extend_run=True) == 4  # the old total
    # The same recipe with the flag: nothing to extend, nothing refused.
    assert (
        check_resumable(folder, {"train": {"lr": 1e-3, "max_steps": 4}}, total_steps=4, extend_run=True)
        is None
    )


def test_extend_run_only_lengthens_and_changes_nothing_else(tmp_path: Path):
    folder = _checkpoint(tmp_path, {"train": {"lr": 1e-3, "max_steps": 4}}, total_steps=4)
    with pytest.raises(
        FinetuneError,
        match=r"train\.extend_run only lengthens a run: the checkpoint's run has 4 steps, this recipe gives 2",
    ):
        check_resumable(folder, {"train": {"lr": 1e-3, "max_steps": 2}}, total_steps=2, extend_run=True)
    with pytest.raises(FinetuneError) as err:
        check_resumable(folder, {"train": {"lr": 2e-3, "max_steps": 8}}, total_steps=8, extend_run=True)
    assert "train.lr: 0.001 in the checkpoint, 0.002 now" in str(err.value)
    assert "max_steps" not in str(err.value)  # the lengthening itself is accepted
