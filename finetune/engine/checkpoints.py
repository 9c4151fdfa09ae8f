"""When the loop checkpoints, and what a checkpoint of a run holds (files: finetune.checkpoint)."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from finetune.checkpoint import find_checkpoint, load_rng_state, load_train_state, save_checkpoint
from finetune.engine.extra_state import collect_states, load_extra, save_extra
from finetune.engine.lifecycle import extend_schedule
from finetune.engine.state import LoopState
from finetune.metrics import ProgressLog
from finetune.recipe.yaml_io import dump_yaml

# The settings train.extend_run may raise on resume (the lines changed_on_resume writes for them).
LENGTH_FIELDS = ("train.max_steps:", "train.num_train_epochs:")
FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


def checkpoint(run) -> Path:
    """checkpoints/step-N of the run (accelerate state + the loop state), pushed with hub.strategy
    every_save."""
    check_finite_weights(run, f"checkpoint step-{run.state.step}")
    state = dataclasses.asdict(run.state)
    extra = collect_states(run.extra_state)  # on every process: a state may gather from all of them
    path = save_checkpoint(
        run.accelerator,
        run.output_dir,
        run.state.step,
        {"state": state, "total_steps": run.total_steps},
        dump_yaml(run.recipe_dict),
        total_limit=run.train.save_total_limit,
        write_extra=lambda folder: save_extra(run.extra_state, folder, states=extra),
    )
    run.accelerator.print(f"checkpoint saved: {path}")
    if run.hub.model_id and run.hub.strategy == "every_save" and run.accelerator.is_main_process:
        push_checkpoint(run, path)
    return path


def push_checkpoint(run, path: Path, *, attempts: int = 3, wait_s: float = 2.0) -> bool:
    """hub.strategy every_save: push the checkpoint, retrying; a Hub that stays unreachable is a warning
    and training goes on (the checkpoint is safe on disk; the final push happens at the end)."""
    from finetune.engine.outputs import push_with_retries
    from finetune.hub import push_folder
    from finetune.notices import warn

    _, error = push_with_retries(
        lambda: push_folder(
            path,
            run.hub.model_id,
            private=run.hub.private,
            commit_message=f"checkpoint step {run.state.step}",
            path_in_repo=f"checkpoints/{path.name}",
        ),
        attempts=attempts,
        wait_s=wait_s,
    )
    if error is not None:
        warn(
            f"hub.strategy every_save: pushing {path.name} to {run.hub.model_id} failed {attempts} times "
            f"({type(error).__name__}: {error}); training goes on, the checkpoint is on disk",
            emit=run.accelerator.print,
        )
    return error is None


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
    extended_from = check_resumable(
        path, run.recipe_dict, total_steps=run.total_steps, extend_run=run.train.extend_run
    )
    check_no_pickled_objects(path)
    with tensors_only_loads(path):
        acc.load_state(str(path))
    load_rng_state(path, acc.process_index)  # finetune's own file: restored exactly, or an error
    load_extra(run.extra_state, path)
    run.state = LoopState.from_dict(load_train_state(path)["state"])
    run.resumed_at = run.state.step
    acc.print(f"resumed from {path} at step {run.state.step}")
    if extended_from is not None:
        extend_schedule(run, extended_from)
    elif run.train.extend_run:
        acc.print(f"train.extend_run: {path} is from a run of this length already; nothing to extend")


def check_no_pickled_objects(path: Path) -> None:
    """Refuse a checkpoint holding custom_checkpoint_N.pkl: accelerate unpickles such a file with
    weights_only=False for an object given to register_for_checkpointing. finetune registers none
    (extra state goes to finetune.engine.extra_state), so the file is an EMA pickled by an older
    finetune, or planted."""
    from finetune.errors import FinetuneError

    found = sorted(p.name for p in path.glob("custom_checkpoint_*.pkl"))
    if found:
        raise FinetuneError(
            f"{path} holds {', '.join(found)}: pickled state, which this finetune never writes nor loads "
            "(unpickling it could run code). It is a diffusion EMA saved by an older finetune, or a "
            "planted file: resume from a checkpoint this version wrote, or start the run again"
        )


@contextmanager
def tensors_only_loads(checkpoint: Path) -> Iterator[None]:
    """Within the block every torch.load unpickles tensors and plain values only, whatever its caller
    asked for; a file holding anything else is a FinetuneError naming `checkpoint`.

    A checkpoint folder is input: whoever can write it (or the Hub repo that hub.strategy every_save
    pushes to) can plant a file, and rewrite checksums.json to match. accelerate loads objects given
    to register_for_checkpointing with weights_only=False and DeepSpeed its own files too; torch's
    TORCH_FORCE_WEIGHTS_ONLY_LOAD overrides every such call (it is read at each torch.load).
    """
    import pickle

    from finetune.errors import FinetuneError

    before = os.environ.get(FORCE_WEIGHTS_ONLY)
    os.environ[FORCE_WEIGHTS_ONLY] = "1"
    try:
        with torch.serialization.safe_globals(_deepspeed_state_classes() + _optimizer_state_classes()):
            yield
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FinetuneError(
            f"{checkpoint}: a file in it holds objects other than tensors and plain values ({first}); "
            "it was not loaded, since unpickling it could run code. A checkpoint finetune wrote never "
            "holds one: resume from another checkpoint (`finetune checkpoints OUTPUT_DIR` lists them)"
        ) from None
    finally:
        if before is None:
            os.environ.pop(FORCE_WEIGHTS_ONLY, None)
        else:
            os.environ[FORCE_WEIGHTS_ONLY] = before


def _deepspeed_state_classes() -> list:
    """The plain-data classes DeepSpeed pickles into its ZeRO optimizer state (the stage enum, the
    loss scaler, whose attributes are numbers and a dtype, and fragment addresses): allowed by name, so
    that its checkpoints load tensors-only too. None when DeepSpeed is not in use."""
    if "deepspeed" not in sys.modules:
        return []
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def _optimizer_state_classes() -> list:
    """Plain-data classes an optimizer keeps in its state: GaLore's projector (rank, gap, scale, type and
    its projection matrix, restored attribute by attribute, no code of its own runs). Allowed by name
    when galore_torch is in use."""
    if "galore_torch" not in sys.modules:
        return []
    from galore_torch.galore_projector import GaLoreProjector

    return [GaLoreProjector]


def check_resumable(
    path: Path, recipe_dict: dict, *, total_steps: int | None = None, extend_run: bool = False
) -> int | None:
    """Refuse a resume whose recipe changes what the checkpoint's run was doing, naming each change.

    A resumed run continues the checkpoint's optimizer state, LR schedule and data order: a new lr or
    max_steps would be ignored or make the schedule jump, so the change is refused rather than
    recorded in recipe.resolved.yaml without taking effect. The one exception is asked for by name:
    with `extend_run`, a larger max_steps or num_train_epochs that lengthens the run past the
    checkpoint's total is accepted; then the checkpoint run's total steps are returned (else None).
    """
    from finetune.errors import FinetuneError
    from finetune.recipe.resume import changed_on_resume
    from finetune.recipe.yaml_io import read_yaml

    saved_file = path / "recipe.resolved.yaml"
    if not saved_file.is_file():
        return None
    # Which settings count is marked in the recipe schema (finetune.recipe.resume), not here.
    changes = changed_on_resume(read_yaml(saved_file), recipe_dict)
    length = [line for line in changes if line.startswith(LENGTH_FIELDS)]
    saved_total = load_train_state(path).get("total_steps") if length else None
    hint = ""
    if length and not extend_run:
        hint = (
            "\nTo train longer than the checkpoint's run, keep the other settings and add "
            "--train.extend_run true (the LR schedule is then rebuilt for the new length)."
        )
    elif length and total_steps is not None and saved_total is not None and total_steps > saved_total:
        changes = [line for line in changes if line not in length]
        if not changes:
            return saved_total
    elif length:
        hint = (
            f"\ntrain.extend_run only lengthens a run: the checkpoint's run has {saved_total} steps, this "
            f"recipe gives {total_steps}."
        )
    if changes:
        raise FinetuneError(
            f"cannot resume from {path} with a changed recipe: a resumed run continues the checkpoint's "
            "optimizer, schedule and data order, so these changes would not take effect as written:\n  - "
            + "\n  - ".join(changes)
            + "\nRestore them to resume, or start a new run (another train.output_dir, or "
            "--train.load_checkpoint_path null)" + hint
        )
    return None


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


def check_finite_weights(run, what: str) -> None:
    """Refuse to write trained weights that are not finite (they would replace good ones on disk).

    Nonfinite steps never update the weights, so this only fires when something else broke them;
    it is one pass over the trainable parameters per save (a sync point).
    """
    from finetune.errors import FinetuneError

    bad = [
        n for n, p in run.model.named_parameters() if p.requires_grad and not bool(torch.isfinite(p).all())
    ]
    if bad:
        raise FinetuneError(
            f"not writing {what}: {len(bad)} trained tensor(s) hold inf or NaN (first: {bad[0]}); the "
            "checkpoints already on disk are kept. Resume from the last one with a lower train.lr"
        )
