"""What a run does about the runs before it in its output_dir: one run at a time (a lock), a finished
run left alone, a finished run made longer (train.extend_run).

* **One run per output_dir**: two runs writing one folder would replace each other's checkpoints,
  adapter, card and resolved recipe and interleave progress.jsonl. The main process takes a lock on
  output_dir (finetune.locks) before anything is written there and holds it to the end; a second run
  stops with an error naming the first (pid, host, start time). A lock left by a killed run is taken
  over with a note. The other processes follow the main one's verdict, so they never wait on it.
* **A finished run** ends its progress.jsonl with `{"event": "finished"}`. Resuming it with the
  same trajectory would only repeat the final evaluation and save: the run says it is finished and
  exits 0 without writing anything.
* **Extending a run**: resuming with a larger max_steps or num_train_epochs is refused (it changes
  the LR schedule) unless train.extend_run says so; then the schedule is rebuilt for the new total
  and goes on from the checkpoint's step (`extend_schedule`).

Test hook: `FINETUNE_TRAIN_PAUSE_S=<seconds>` pauses the start of a run (output_dir locked, before the
model and data are built), printing `finetune-train: paused`
to stderr, until the time is up or a file named `.resume-startup` appears in output_dir. Tests use
it to hold a run at startup: to start a second one beside it, or to signal or kill it there.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from finetune.engine.outputs import push_later_command
from finetune.errors import FinetuneError
from finetune.locks import LockHeld, OwnedLock, describe_owner
from finetune.notices import hold_for_test, warn

PAUSE_ENV = "FINETUNE_TRAIN_PAUSE_S"
LOCK_NAME = ".train"  # output_dir/.train.lock and .train.owner.json: hidden, never pushed
FINISHED = "finished"


def check_output_dir(output_dir: Path) -> None:
    """Create train.output_dir, or say clearly why it cannot be written (a file, read-only, no space)."""
    if output_dir.exists() and not output_dir.is_dir():
        raise FinetuneError(f"train.output_dir: {output_dir} is a file, not a folder; choose another path")
    probe = output_dir / f".write-test-{os.getpid()}"
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise FinetuneError(
            f"train.output_dir: cannot write to {output_dir}: {exc.strerror or exc}; choose a writable folder"
        ) from None


@contextlib.contextmanager
def hold_output_dir(accelerator, output_dir: Path) -> Iterator[None]:
    """Hold output_dir's lock for the block (main process); every process raises the same FinetuneError
    when another run holds it."""
    lock, problem = None, None
    if accelerator.is_main_process:
        check_output_dir(output_dir)
        lock = OwnedLock(output_dir / LOCK_NAME)
        try:
            stale = lock.acquire()
        except LockHeld as held:
            lock, problem = None, in_use_message(output_dir, held.owner)
        else:
            if stale:
                accelerator.print(
                    f"note: {output_dir} was locked by a run that ended without releasing it "
                    f"({describe_owner(stale)}; killed?): taking the lock over"
                )
    problem = agree(accelerator, problem)
    if problem is not None:
        raise FinetuneError(problem)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def in_use_message(output_dir: Path, owner: dict) -> str:
    return (
        f"train.output_dir {output_dir} is in use by another training run ({describe_owner(owner)}): two "
        "runs into one folder would overwrite each other's checkpoints and outputs. Wait for it to end or "
        "stop it (to resume it later: --train.load_checkpoint_path auto), or choose another train.output_dir"
    )


def agree(accelerator, value):
    """The main process's `value` on every process (a sync point in a multi-process run)."""
    if accelerator.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    box = [value]
    broadcast_object_list(box)
    return box[0]


def startup_pause(output_dir: Path) -> None:
    """The FINETUNE_TRAIN_PAUSE_S test hook (module docstring)."""
    hold_for_test("train", float(os.environ.get(PAUSE_ENV) or 0), release=output_dir / ".resume-startup")


# ------------------------------------------------------------------------------------ finished runs


def mark_finished(output_dir: Path, step: int) -> None:
    """The last line of progress.jsonl once the final evaluation, save and push are done."""
    with open(output_dir / "progress.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, "event": FINISHED}) + "\n")


def finished_message(output_dir: Path, spec: str | None, recipe_dict: dict) -> str | None:
    """What to say when resuming (train.load_checkpoint_path `spec`) would only repeat a finished run:
    its progress.jsonl ends with the finished record, the checkpoint to resume is `latest` (`auto`) or
    one of the last step, and its recipe has the same trajectory (no change a resume refuses, so no
    extension either). None otherwise: the resume goes on (and refuses what it refuses)."""
    from finetune.checkpoint import checkpoints_dir, read_latest
    from finetune.recipe.resume import changed_on_resume
    from finetune.recipe.yaml_io import read_yaml

    if spec is None:
        return None
    record = last_record(output_dir / "progress.jsonl")
    if record.get("event") != FINISHED:
        return None
    if spec == "auto":
        latest = read_latest(checkpoints_dir(output_dir))
        checkpoint = checkpoints_dir(output_dir) / latest if latest else None
    else:
        checkpoint = Path(spec) if checkpoint_step(Path(spec)) == record.get("step") else None
    saved = checkpoint / "recipe.resolved.yaml" if checkpoint is not None else None
    if saved is None or not saved.is_file() or changed_on_resume(read_yaml(saved), recipe_dict):
        return None
    hub, hub_upload = recipe_dict.get("hub") or {}, output_dir / "hub-upload"
    pending = ""
    if hub_upload.is_dir() and hub.get("model_id"):
        command = push_later_command(hub["model_id"], hub_upload, private=bool(hub.get("private")))
        pending = f" Its final Hub push failed; push it with: {command}."
    return (
        f"{output_dir} holds a finished run: all {record.get('step')} steps trained, final outputs written in "
        f"{output_dir}; nothing to resume, nothing written.{pending} To train longer, raise train.max_steps "
        "or train.num_train_epochs and add --train.extend_run true; to train again from scratch, drop "
        "train.load_checkpoint_path or choose another train.output_dir"
    )


def last_record(path: Path) -> dict:
    """The last JSON object of a progress.jsonl ({} if none), reading only the file's end."""
    try:
        with open(path, "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - 65536, 0))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        if line.strip():
            try:
                record = json.loads(line)
            except ValueError:
                return {}
            return record if isinstance(record, dict) else {}
    return {}


def checkpoint_step(path: Path) -> int | None:
    from finetune.checkpoint import load_train_state

    try:
        return load_train_state(path)["state"]["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


# ------------------------------------------------------------------------------------ extended runs


def extend_schedule(run, from_total_steps: int) -> None:
    """Continue a resumed run past its checkpoint's total (train.extend_run): the LR schedule, built for
    run.total_steps, is set to the current step, as if the run had been started with the new length.

    The scheduler loaded from the checkpoint holds its step count but not its length (transformers'
    schedules are LambdaLR over a partial that the state dict does not carry), so the one built for the
    new total already continues from the step; only the LR the optimizer holds is still the old
    schedule's. Stepping the scheduler to the same step again (its own arithmetic) sets it.
    """
    scheduler = getattr(
        run.scheduler, "scheduler", run.scheduler
    )  # accelerate's wrapper, or DeepSpeed's raw one
    before = scheduler.get_last_lr()[0]
    scheduler.last_epoch -= 1
    scheduler.step()
    after = scheduler.get_last_lr()[0]
    step, train = run.state.step, run.train
    run.state.extensions.append(
        {"step": step, "from_total_steps": from_total_steps, "to_total_steps": run.total_steps}
    )
    run.extension = {
        "step": step,
        "event": "extended",
        "from_total_steps": from_total_steps,
        "to_total_steps": run.total_steps,
        "lr": after,
    }
    warm = int(train.lr_warmup_ratio * run.total_steps)
    warn(
        f"train.extend_run: the run goes on from step {step} to {run.total_steps} (it had {from_total_steps} "
        f"steps); the LR schedule is rebuilt for {run.total_steps} steps ({warm} warmup, {train.lr_decay_style} "
        f"to lr_min at step {run.total_steps}) and continues at step {step}: the LR goes from {before:.4g} to "
        f"{after:.4g}",
        emit=run.accelerator.print,
    )
