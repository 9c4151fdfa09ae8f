"""When the loop checkpoints, and what a checkpoint of a run holds (files: finetune.checkpoint)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from finetune.checkpoint import find_checkpoint, load_train_state, save_checkpoint
from finetune.engine.state import LoopState
from finetune.metrics import ProgressLog
from finetune.recipe.yaml_io import dump_yaml


def checkpoint(run) -> Path:
    """checkpoints/step-N of the run (accelerate state + the loop state), pushed with hub.strategy
    every_save."""
    state = dataclasses.asdict(run.state)
    path = save_checkpoint(
        run.accelerator,
        run.output_dir,
        run.state.step,
        {"state": state, "total_steps": run.total_steps},
        dump_yaml(run.recipe_dict),
        total_limit=run.train.save_total_limit,
    )
    run.accelerator.print(f"checkpoint saved: {path}")
    if run.hub.model_id and run.hub.strategy == "every_save" and run.accelerator.is_main_process:
        from finetune.hub import push_folder

        push_folder(
            path,
            run.hub.model_id,
            private=run.hub.private,
            commit_message=f"checkpoint step {run.state.step}",
            path_in_repo=f"checkpoints/{path.name}",
        )
    return path


def resume(run) -> None:
    """Load train.load_checkpoint_path (a path, or `auto`: the newest verified one in output_dir).

    The main process verifies the checkpoint files (checksums) and chooses; the others follow its
    choice, so a multi-process run hashes the files once.
    """
    acc, spec = run.accelerator, run.train.load_checkpoint_path
    if spec is None:
        return
    choice: list = [None]
    if acc.is_main_process:
        path = find_checkpoint(spec, run.output_dir, say=acc.print)
        choice = [str(path) if path is not None else None]
    if acc.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(choice)  # sync point
    if choice[0] is None:
        return
    path = Path(choice[0])
    acc.load_state(str(path))
    run.state = LoopState.from_dict(load_train_state(path)["state"])
    acc.print(f"resumed from {path} at step {run.state.step}")


def checkpoint_if_stopped(run, log: ProgressLog) -> None:
    """A run stopped by a signal or the time limit ends with a checkpoint to resume from."""
    if run.stop_reason is not None:
        path = checkpoint(run)
        log.message(
            f"stopping: {run.stop_reason}; checkpoint at {path}. Resume with --train.load_checkpoint_path auto"
        )


def should_save(run) -> bool:
    """save_steps (every N optimizer steps) and save_epochs (every N epochs, fractions allowed)."""
    train, step = run.train, run.state.step
    if train.save_steps and step % train.save_steps == 0:
        return True
    if train.save_epochs:
        return crosses_epoch_mark(step, steps_per_epoch=run.steps_per_epoch, save_epochs=train.save_epochs)
    return False


def crosses_epoch_mark(step: int, *, steps_per_epoch: int, save_epochs: float) -> bool:
    """Whether optimizer step `step` is the first at or after a multiple of `save_epochs` epochs.

    Marks are placed in epochs, not as a rounded step interval, so they do not drift away from
    epoch ends: with 7 steps per epoch and save_epochs 0.5, saves land on steps 4, 7, 11, 14.

    >>> [s for s in range(1, 15) if crosses_epoch_mark(s, steps_per_epoch=7, save_epochs=0.5)]
    [4, 7, 11, 14]
    """
    interval = save_epochs * steps_per_epoch  # in optimizer steps, possibly fractional
    # The small epsilon keeps a mark that lands exactly on a step (e.g. 3 x 1/3 epoch) on that step.
    return math.floor(step / interval + 1e-9) > math.floor((step - 1) / interval + 1e-9)


def schedule_length(
    num_batches: int, *, gradient_accumulation_steps: int, num_train_epochs: float, max_steps: int | None
) -> tuple[int, int]:
    """(optimizer steps per epoch, total optimizer steps) for `num_batches` micro-batches per epoch.

    The last accumulation window of an epoch may be short; it still makes one optimizer step.
    `max_steps`, when set, overrides the epochs.

    >>> schedule_length(10, gradient_accumulation_steps=4, num_train_epochs=2, max_steps=None)
    (3, 6)
    """
    steps_per_epoch = math.ceil(num_batches / gradient_accumulation_steps)
    total_steps = max_steps or math.ceil(num_train_epochs * steps_per_epoch)
    return steps_per_epoch, total_steps
