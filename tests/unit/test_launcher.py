"""finetune.launcher: a stop signal that comes before the launcher has started training. Real processes
and signals: the slow tier."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from finetune.launcher import run_supervised

pytestmark = pytest.mark.slow  # processes started, signalled and killed


def test_a_stop_before_the_launcher_started_training_is_a_clean_exit(capsys):
    """SIGTERM to `finetune train` while the launcher is still importing (no training process yet): the
    launcher is ended and `finetune train` exits 0 with one line, as a stop during startup does."""
    launcher = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]
    # Sent to this process, where run_supervised's forwarder handles it.
    sent = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM))
    sent.start()
    started = time.monotonic()
    try:
        code = run_supervised(launcher)
    finally:
        sent.cancel()
    assert code == 0 and time.monotonic() - started < 30
    err = capsys.readouterr().err
    assert "finetune train: SIGTERM: asking training to checkpoint and stop" in err
    assert err.rstrip().endswith("finetune train: stopped before training started; nothing to save")


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_training_processes_end_with_their_supervisor(reaped):
    """`finetune train` runs the launcher in a session of its own (terminal signals stay away from it),
    so a SIGKILL of `finetune train`'s process group would leave training running as an orphan, into
    the output_dir the next run resumes (found by the GRPO SIGKILL test once output_dirs were locked).
    A process under watch_supervisor ends its session once the supervisor is gone, also while the dead
    supervisor is a zombie nobody reaps (a container whose first process does not reap orphans)."""
    import subprocess

    from finetune.launcher import SUPERVISOR_ENV

    supervisor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    code = (
        "import time\nfrom finetune.launcher import watch_supervisor\n"
        "assert watch_supervisor() is not None\nprint('watching', flush=True)\ntime.sleep(60)\n"
    )
    env = {**os.environ, SUPERVISOR_ENV: str(supervisor.pid)}
    # Its own session, as the launcher's: the kill it sends reaches its group only.
    child = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert child.stdout.readline().strip() == "watching"
        time.sleep(0.5)
        assert child.poll() is None  # the supervisor lives: so does training
        supervisor.kill()
        if reaped:
            supervisor.wait()
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        for proc in (supervisor, child):
            if proc.poll() is None:
                proc.kill()


def test_a_process_not_under_finetune_train_watches_nothing(monkeypatch):
    from finetune.launcher import SUPERVISOR_ENV, watch_supervisor

    monkeypatch.delenv(SUPERVISOR_ENV, raising=False)
    assert watch_supervisor() is None


def test_the_error_starts_a_line_of_its_own_after_a_progress_bar(capsys):
    """Training draws its progress bar (no newline), reports a user error, then prints it: the relay drops
    what follows the report, the newline before the message with it, and `finetune train` prints the
    message itself. It must start a line, not end the bar's (fault trials under load: 3 of 9 rewards)."""
    training = (
        "import sys, time\n"
        "from finetune.launcher import write_status\n"
        "sys.stderr.write('\\rtrain:   0%|          | 0/2 [00:00<?, ?step/s]'); sys.stderr.flush()\n"
        "time.sleep(2)\n"  # the relay shows the bar before the report exists
        "write_status(2, 'reward f returned a dict')\n"
        "sys.stderr.write('\\nerror: reward f returned a dict\\n'); sys.stderr.flush()\n"
        "sys.exit(1)\n"
    )
    code = run_supervised([sys.executable, "-c", training])
    assert code == 2
    err = capsys.readouterr().err
    assert "error: reward f returned a dict" in err.splitlines(), err
