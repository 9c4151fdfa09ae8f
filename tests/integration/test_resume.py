"""Exact resume after SIGKILL, and a clean checkpoint-and-exit on SIGTERM (DESIGN.md invariants): real
processes, killed and signalled (slow tier). What resuming refuses or skips, and a full disk, run
finetune/train.py's main in this process (tests/inprocess.py: the fast tier)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import inprocess
from tests.integration._run import (
    DEMO,
    REPO,
    accelerate_cmd,
    demo_overrides,
    env,
    progress,
    run,
    step_losses,
    train_here,
)

slow = pytest.mark.slow  # real processes: killed, signalled, or the launcher itself

STEPS = 16
COMMON = (
    "--train.max_steps",
    str(STEPS),
    "--train.log_steps",
    "1",
    "--train.save_steps",
    "4",
    "--train.save_epochs",
    "0",
    "--train.log_format",
    "structured",
    "--train.eval_steps",
    "null",
    "--train.save_hf_weights",
    "false",
    "--lora.lora_dropout",
    "0.1",
    "--train.micro_batch_size",
    "2",
    "--train.gradient_accumulation_steps",
    "2",
)

# Until stopped: a step logged every step, no checkpoint but the one stopping makes.
UNTIL_STOPPED = ("--train.log_steps", "1", "--train.max_steps", "100000", "--train.save_steps", "0",
                 "--train.save_epochs", "0", "--train.log_format", "structured")  # fmt: skip


def _wait_for(predicate, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    return False


def train(prepared: Path, *args: str) -> subprocess.CompletedProcess:
    """finetune/train.py DEMO ARGS in this process on the session's prepared demo data (`prepared`); its
    output free of the notices finetune silences."""
    return train_here(DEMO, *args, "--data.dataset_prepared_path", str(prepared))


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory, demo_prepared) -> dict:
    """An uninterrupted run (COMMON), and the same run killed with SIGKILL after its step-8 checkpoint
    once at least one later step is logged, then resumed with `auto` into the same folder."""
    tmp = tmp_path_factory.mktemp("sigkill")
    prepared = ("--data.dataset_prepared_path", str(demo_prepared))  # the session's (tests/conftest.py)
    ref = run(accelerate_cmd(DEMO, *demo_overrides(tmp / "ref", *COMMON, *prepared)))
    assert ref.returncode == 0, ref.stderr[-4000:]

    out = tmp / "kill" / "out"
    cmd = accelerate_cmd(DEMO, *demo_overrides(tmp / "kill", *COMMON, *prepared))
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    latest = out / "checkpoints" / "latest"

    def past_a_checkpoint() -> bool:  # a step after the checkpoint is logged: the resume replays it
        k = int(latest.read_text().strip()[5:] or 0) if latest.is_file() else 0
        return k >= 8 and max(step_losses(progress(out)), default=0) > k

    reached = _wait_for(past_a_checkpoint, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert reached, "the run ended before it could be killed"
    killed_at = max(step_losses(progress(out)))
    k = int(latest.read_text().strip()[5:])
    assert 8 <= k < killed_at < STEPS
    resumed = run([*cmd, "--train.load_checkpoint_path", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    return {"ref": tmp / "ref" / "out", "out": out, "checkpoint": k, "resumed": resumed}


@slow
def test_sigkill_then_resume_gives_the_same_losses(killed_and_resumed):
    ref_losses = step_losses(progress(killed_and_resumed["ref"]))
    assert sorted(ref_losses) == list(range(1, STEPS + 1))
    out, k, resumed = (
        killed_and_resumed["out"],
        killed_and_resumed["checkpoint"],
        killed_and_resumed["resumed"],
    )
    assert f"resumed from {out / 'checkpoints' / f'step-{k}'}" in resumed.stdout + resumed.stderr
    after = step_losses(progress(out))  # the resumed run appends; later records win
    for step in range(1, STEPS + 1):
        assert after[step] == pytest.approx(ref_losses[step], abs=1e-6), step


def _sigterm_once_training(cmd: list[str], out: Path, timeout: int) -> tuple[str, str]:
    """Run `cmd` (a run that would go on for 100000 steps, checkpointing only when stopped) and send it
    SIGTERM once 3 steps are logged: it exits 0 with a checkpoint of its last step. Returns its
    output and the checkpoint's name."""
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert _wait_for(lambda: len(step_losses(progress(out))) >= 3, proc), "training did not start"
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, output[-3000:]
    assert "stopping: received SIGTERM" in output
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert int(latest[5:]) == max(step_losses(progress(out)))
    return output, latest


@slow
def test_sigterm_checkpoints_and_exits_zero(tmp_path, demo_prepared):
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        str(REPO / "finetune" / "train.py"),
        str(DEMO),
        *demo_overrides(tmp_path, *UNTIL_STOPPED, "--data.dataset_prepared_path", str(demo_prepared)),
    ]
    _, latest = _sigterm_once_training(cmd, out, timeout=120)
    assert (out / "checkpoints" / latest / "train_state.json").is_file()


@slow
def test_resume_after_sigkill_logs_each_step_once_and_marks_the_resume(killed_and_resumed):
    """The resumed run replaces the log's records after its checkpoint (replayed steps are not
    doubled) and marks where it resumed."""
    records = [r for r in progress(killed_and_resumed["out"]) if r.get("event") != "started"]  # each start's
    steps = [r["step"] for r in records if r.get("event") is None]
    assert steps == list(range(1, STEPS + 1))  # every step once, in order
    (mark,) = [r for r in records if r.get("event") == "resumed"]
    assert mark["step"] == killed_and_resumed["checkpoint"]
    assert records.index(mark) == steps.index(mark["step"]) + 1


def _unfinish(out: Path) -> None:
    """The finished run as one killed after its last checkpoint, before its final save: its
    progress.jsonl without the closing "finished" record (a finished run resumed only says so)."""
    path = out / "progress.jsonl"
    lines = [ln for ln in path.read_text().splitlines() if json.loads(ln).get("event") != "finished"]
    assert len(lines) < len(path.read_text().splitlines()), "the run did not record that it finished"
    path.write_text("".join(ln + "\n" for ln in lines))


def test_a_damaged_newest_checkpoint_is_skipped_with_the_reason(tmp_path, demo_prepared):
    out = tmp_path / "out"
    args = [*demo_overrides(tmp_path, *COMMON), "--train.max_steps", "8", "--train.save_total_limit", "null"]
    first = train(demo_prepared, *args)
    assert first.returncode == 0, first.stderr[-3000:]
    newest = out / "checkpoints" / "step-8"
    weights = newest / "trainable_0.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # an interrupted copy
    _unfinish(out)
    again = train(demo_prepared, *args, "--train.load_checkpoint_path", "auto")
    output = again.stdout + again.stderr
    assert again.returncode == 0 and "Traceback" not in output, output[-3000:]
    assert f"warning: resume: skipping {newest}: {weights} has 100 bytes" in output
    assert f"resumed from {out / 'checkpoints' / 'step-4'} at step 4" in output
    weights.write_bytes(weights.read_bytes()[:100])  # the resumed run wrote step-8 again: damage it again
    _unfinish(out)
    explicit = train(demo_prepared, *args, "--train.load_checkpoint_path", str(newest))
    assert explicit.returncode == 2 and "Traceback" not in explicit.stderr
    assert f"error: train.load_checkpoint_path: {newest} cannot be resumed: {weights}" in explicit.stderr


def test_resume_with_a_changed_learning_rate_is_refused(tmp_path, demo_prepared):
    args = [*demo_overrides(tmp_path, *COMMON), "--train.max_steps", "4"]
    first = train(demo_prepared, *args)
    assert first.returncode == 0, first.stderr[-3000:]
    changed = train(
        demo_prepared,
        *args,
        "--train.max_steps",
        "8",
        "--train.lr",
        "1e-4",
        "--train.load_checkpoint_path",
        "auto",
    )
    assert changed.returncode == 2 and "Traceback" not in changed.stderr
    assert "cannot resume from" in changed.stderr
    assert "train.lr: 0.003 in the checkpoint, 0.0001 now" in changed.stderr
    assert "train.max_steps: 4 in the checkpoint, 8 now" in changed.stderr
    assert "add --train.extend_run true" in changed.stderr  # how to ask for a longer run


@slow
def test_finetune_train_forwards_sigterm_and_waits_for_the_checkpoint(tmp_path, demo_prepared):
    """SIGTERM to `finetune train` alone (as `docker stop` sends it) reaches training, which checkpoints;
    finetune train exits 0 once it has."""
    cmd = [
        sys.executable,
        "-m",
        "finetune.cli",
        "train",
        str(DEMO),
        *demo_overrides(tmp_path, *UNTIL_STOPPED, "--data.dataset_prepared_path", str(demo_prepared)),
    ]
    output, _ = _sigterm_once_training(cmd, tmp_path / "out", timeout=180)
    assert "asking training to checkpoint and stop" in output


@slow
def test_finetune_train_reports_a_training_error_with_exit_2_and_no_traceback(tmp_path):
    result = run(
        [sys.executable, "-m", "finetune.cli", "train", str(DEMO), *demo_overrides(tmp_path),
         "--train.load_checkpoint_path", str(tmp_path / "no" / "step-3")]
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert "error: train.load_checkpoint_path:" in result.stderr and "cannot be resumed" in result.stderr
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr


def test_a_fresh_run_into_a_used_folder_keeps_the_old_log(tmp_path, demo_prepared):
    args = [*demo_overrides(tmp_path, *COMMON), "--train.max_steps", "2", "--train.save_steps", "0"]
    for _ in range(2):
        result = train(demo_prepared, *args)
        assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    assert "held another run's progress.jsonl: kept as progress.1.jsonl" in result.stdout
    assert [r["step"] for r in progress(out) if r.get("event") is None] == [1, 2]
    assert (out / "progress.1.jsonl").is_file()


def test_an_output_dir_that_is_a_file_is_a_clear_error(tmp_path, demo_prepared):
    (tmp_path / "out").write_text("not a folder")
    result = train(demo_prepared, *demo_overrides(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"train.output_dir: {tmp_path / 'out'} is a file, not a folder" in result.stderr


@slow
def test_sigkill_while_writing_a_checkpoint_resumes_from_the_previous_one(tmp_path, demo_prepared):
    """Killed with the files of step-8 written but not yet renamed into place (the write held open by
    the FINETUNE_CHECKPOINT_PAUSE_STEP hook, so the kill lands there every time): `latest` still names
    step-4, `auto` resumes from it, the replayed steps log the losses the killed run logged, and the
    run ends with every step and no temporary folder."""
    out = tmp_path / "out"
    prepared = ("--data.dataset_prepared_path", str(demo_prepared))  # the session's (tests/conftest.py)
    cmd = accelerate_cmd(DEMO, *demo_overrides(tmp_path, *COMMON, "--train.max_steps", "10", *prepared))
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**env(), "FINETUNE_CHECKPOINT_PAUSE_STEP": "8"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    partial = out / "checkpoints" / ".tmp-step-8"
    reached = _wait_for(lambda: (partial / "train_state.json").is_file(), proc, timeout=120)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert reached, "the run ended before it wrote step-8"
    root = out / "checkpoints"
    assert (root / "latest").read_text() == "step-4\n" and not (root / "step-8").exists()
    killed = step_losses(progress(out))
    assert sorted(killed) == list(range(1, 9))

    resumed = run([*cmd, "--train.load_checkpoint_path", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resumed from {root / 'step-4'} at step 4" in resumed.stdout + resumed.stderr
    after = step_losses(progress(out))
    assert sorted(after) == list(range(1, 11))
    for step in range(5, 9):
        assert after[step] == pytest.approx(killed[step], abs=1e-6), step
    assert (root / "latest").read_text() == "step-8\n" and (root / "step-8" / "checksums.json").is_file()
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []  # the partial step-8 went


# torch.save's own report of a full disk (taken from a 1 MiB tmpfs), raised for the files of step-2.
DISK_FULL = "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"


def test_a_full_disk_while_checkpointing_is_exit_2_and_keeps_the_last_checkpoint(
    tmp_path, monkeypatch, demo_prepared
):
    import torch

    real = torch.save

    def save(obj, f, *args, **kwargs):
        if ".tmp-step-2" in str(f):
            raise RuntimeError(DISK_FULL)
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    args = [*demo_overrides(tmp_path, *COMMON), "--train.max_steps", "3", "--train.save_steps", "1"]
    result = inprocess.train(DEMO, *args, "--data.dataset_prepared_path", str(demo_prepared))
    root = tmp_path / "out" / "checkpoints"
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert f"error: writing checkpoint {root / 'step-2'}: the write failed ([enforce fail" in result.stderr
    assert "MiB free on that disk" in result.stderr and "choose another train.output_dir" in result.stderr
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-1"]  # no .tmp-step-2 left
    assert (root / "latest").read_text() == "step-1\n"
