"""A run among the runs before and beside it, through the real CLI: one run per output_dir (a second is
refused, a killed one's lock taken over), a stop signal during startup (real processes: slow tier); a
finished run resumed (left alone) or extended (train.extend_run), in this process (tests/inprocess.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from finetune.engine.lifecycle import PAUSE_ENV
from tests.integration._run import DEMO, REPO, cli, env, progress, run, short_run, train_here

slow = pytest.mark.slow  # real processes: paused, killed, signalled

TRAIN_PY = [sys.executable, str(REPO / "finetune" / "train.py")]


@pytest.fixture(scope="module")
def prepared(demo_prepared: Path) -> Path:
    """The session's prepared demo data (tests/conftest.py): each run prepares only what is not there yet."""
    return demo_prepared


def _args(tmp_path: Path, prepared: Path, max_steps: int, save_steps: int) -> list[str]:
    """The demo, small: micro batches of one row, no eval split, into tmp_path/out."""
    return [
        str(DEMO), "--train.output_dir", str(tmp_path / "out"), "--data.dataset_prepared_path", str(prepared),
        *short_run("--train.max_steps", str(max_steps), "--train.save_steps", str(save_steps),
                   "--train.micro_batch_size", "1", "--data.val_set_size", "null"),
    ]  # fmt: skip


class Paused:
    """A training command started with the startup pause hook (finetune.engine.lifecycle); its output is
    collected as it comes."""

    def __init__(self, cmd: list[str]):
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env={**env(), PAUSE_ENV: "300"}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    def wait_paused(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not any("finetune-train: paused" in line for line in self.lines):
            assert self.proc.poll() is None and time.monotonic() < deadline, "".join(self.lines)[-3000:]
            time.sleep(0.05)

    def finish(self, timeout: float = 300) -> str:
        self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        return "".join(self.lines)


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in folder.rglob("*")
        if p.is_file()
    }


@slow
def test_a_second_run_into_a_live_runs_output_dir_exits_2_and_touches_nothing(tmp_path, prepared):
    out = tmp_path / "out"
    args = _args(tmp_path, prepared, max_steps=2, save_steps=2)
    first = Paused([*TRAIN_PY, *args])
    try:
        first.wait_paused()
        before = _snapshot(out)
        second = cli("train", *args)
        assert second.returncode == 2, second.stderr[-3000:]
        assert (
            f"error: train.output_dir {out} is in use by another training run (pid {first.proc.pid} on host "
            f"{socket.gethostname()}, started "
        ) in second.stderr
        assert "choose another train.output_dir" in second.stderr
        assert "Traceback" not in second.stdout + second.stderr
        assert _snapshot(out) == before
        (out / ".resume-startup").touch()  # the first run goes on, alone
        output = first.finish()
    finally:
        if first.proc.poll() is None:
            os.killpg(first.proc.pid, signal.SIGKILL)
    assert first.proc.returncode == 0, output[-3000:]
    assert [r["step"] for r in progress(out) if r.get("event") is None] == [1, 2]
    assert not (out / ".train.owner.json").exists()  # released at its end


@slow
def test_the_lock_of_a_killed_run_is_taken_over_with_a_note(tmp_path, prepared):
    out = tmp_path / "out"
    args = _args(tmp_path, prepared, max_steps=2, save_steps=0)
    killed = Paused([*TRAIN_PY, *args])
    try:
        killed.wait_paused()
    finally:
        os.killpg(killed.proc.pid, signal.SIGKILL)
        killed.finish()
    assert (out / ".train.owner.json").is_file()  # a SIGKILL leaves its record behind
    result = run([*TRAIN_PY, *args])
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        f"note: {out} was locked by a run that ended without releasing it (pid {killed.proc.pid} on host "
        f"{socket.gethostname()}, started "
    ) in result.stdout
    assert [r["step"] for r in progress(out) if r.get("event") is None] == [1, 2]


@slow
def test_sigterm_during_startup_stops_cleanly(tmp_path, prepared):
    """SIGTERM to `finetune train` while training loads (as `docker stop` sends it): one line, exit 0,
    no traceback from the launcher, the lock released."""
    out = tmp_path / "out"
    starting = Paused([sys.executable, "-m", "finetune.cli", "train", *_args(tmp_path, prepared, 2, 0)])
    try:
        starting.wait_paused()
        starting.proc.send_signal(signal.SIGTERM)
        output = starting.finish(timeout=120)
    finally:
        if starting.proc.poll() is None:
            os.killpg(starting.proc.pid, signal.SIGKILL)
    assert starting.proc.returncode == 0, output[-3000:]
    assert "stopping: received SIGTERM during startup, before the first step; nothing trained" in output
    assert "Traceback" not in output and "CalledProcessError" not in output
    assert not (out / "checkpoints").exists() and not (out / ".train.owner.json").exists()


def _lr_after(steps: int, total_steps: int) -> float:
    """The demo recipe's LR (3e-3, cosine, warmup ratio 0.05) after `steps` of a `total_steps` schedule."""
    import torch

    from finetune.optim import build_scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-3)
    scheduler = build_scheduler(
        optimizer, style="cosine", num_warmup_steps=int(0.05 * total_steps), num_training_steps=total_steps,
        lr=3e-3, lr_min=0.0,
    )  # fmt: skip
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    return scheduler.get_last_lr()[0]


def test_a_finished_run_is_left_alone_and_extend_run_trains_it_longer(tmp_path, prepared):
    out = tmp_path / "out"
    args = _args(tmp_path, prepared, max_steps=4, save_steps=4)
    first = train_here(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    before = _snapshot(out)

    again = train_here(*args, "--train.load_checkpoint_path", "auto")
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr[-3000:]
    assert f"{out} holds a finished run: all 4 steps trained" in again.stdout
    assert "add --train.extend_run true" in again.stdout
    assert _snapshot(out) == before  # no eval, save or log line again

    longer = train_here(
        *args, "--train.max_steps", "8", "--train.load_checkpoint_path", "auto", "--train.extend_run", "true"
    )
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert "warning: train.extend_run: the run goes on from step 4 to 8 (it had 4 steps)" in longer.stdout
    records = progress(out)
    assert [r["step"] for r in records if r.get("event") is None] == list(range(1, 9))
    (extended,) = [r for r in records if r.get("event") == "extended"]
    assert extended == {
        "step": 4, "event": "extended", "from_total_steps": 4, "to_total_steps": 8, "lr": pytest.approx(_lr_after(4, 8)),
    }  # fmt: skip
    lrs = {r["step"]: r["lr"] for r in records if r.get("event") is None}
    for step in range(5, 9):  # the LR of a run planned for 8 steps from the start
        assert lrs[step] == pytest.approx(_lr_after(step - 1, 8)), step
    assert [r for r in records if r.get("event") == "finished"] == [{"step": 8, "event": "finished"}]
    assert (
        "the run of 4 steps was extended to 8 steps (`train.extend_run`)" in (out / "README.md").read_text()
    )
