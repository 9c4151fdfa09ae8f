"""finetune.launcher: a stop signal that comes before the launcher has started training."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from finetune.launcher import run_supervised


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
