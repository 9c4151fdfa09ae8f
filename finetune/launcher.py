"""`finetune train` runs the launcher (`accelerate launch` or torchrun) under supervision.

Three things a bare `exec` of the launcher gets wrong, each found by fault injection:

* A signal sent to the launcher only (`docker stop`, a scheduler's SIGTERM, `kill <pid>`) never
  reaches the training processes: no checkpoint is written and, outside a container, training runs
  on after the launcher is gone. Here the launcher runs in a session of its own, and SIGTERM, SIGINT
  and SIGHUP are forwarded to the training processes (the launcher's children), not to the launcher,
  so the launcher stays until they have written their checkpoint and exited; a second Ctrl-C stops
  everything at once.
* Ctrl-C in a terminal reaches the whole foreground process group: the launcher would exit at once
  (130/143) while training is still writing its checkpoint. The launcher's own session keeps the
  terminal's signals away from it.
* Its own session also keeps a SIGKILL of `finetune train`'s process group (a scheduler's hard kill,
  `kill -9 -PGID`) away from the launcher and training, which would then train on as orphans, into the
  output_dir the next run resumes. Each training process watches the supervisor
  (FINETUNE_SUPERVISOR_PID, `watch_supervisor`) and kills its session once the supervisor is gone.
* A user error inside training (exit code 2 and one `error:` line) comes back from the launcher as
  exit 1 with its own traceback. The training process records its error in a status file
  (FINETUNE_STATUS_FILE); once it has, what the launcher prints is dropped and `finetune train`
  exits 2 with the message alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

STATUS_ENV = "FINETUNE_STATUS_FILE"
SUPERVISOR_ENV = "FINETUNE_SUPERVISOR_PID"
SUPERVISOR_POLL_S = 0.2
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # what the training loop stops on (engine.loop.StopFlag)


class StoppedAtStartup(BaseException):
    """A stop signal before the training loop took over its handling (loading the model, preparing data).

    A BaseException, as KeyboardInterrupt is, so that no `except Exception` on the way swallows it.
    """


def stop_at_startup_on_signals() -> dict:
    """Until the loop installs its own handlers (checkpoint, then stop), SIGTERM and SIGINT end startup
    at once: nothing has trained yet, so there is nothing to save. Without this, SIGTERM's default
    action kills the process and the launcher reports it with a traceback and exit 1. Returns the
    handlers it replaced."""

    def stop(signum, frame):
        raise StoppedAtStartup(signal.Signals(signum).name)

    return {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}


def watch_supervisor() -> threading.Thread | None:
    """In a training process started by `finetune train`: once the supervisor (FINETUNE_SUPERVISOR_PID)
    is gone, SIGKILL the launcher's session (the launcher and every training process on this machine),
    as the supervisor's own death would have done without the session that shields them from terminal
    signals. Only a SIGKILL ends the supervisor before training (it outlives training otherwise: it
    waits for the launcher), so stopping at once is what was asked. A daemon thread polling every
    SUPERVISOR_POLL_S; None when not supervised. (Linux's PR_SET_PDEATHSIG would reach only the
    launcher, one level down; the training processes are its children or grandchildren.)"""
    pid = os.environ.get(SUPERVISOR_ENV)
    if not pid or not pid.isdigit():
        return None

    def watch() -> None:
        while alive(int(pid)):
            time.sleep(SUPERVISOR_POLL_S)
        with contextlib.suppress(OSError):
            os.killpg(os.getpgid(0), signal.SIGKILL)
        os._exit(137)  # not in the launcher's group (started otherwise): end this process at least

    thread = threading.Thread(target=watch, name="finetune-supervisor-watch", daemon=True)
    thread.start()
    return thread


def alive(pid: int) -> bool:
    """Whether process `pid` runs. A killed process stays a zombie until its parent reaps it, and where
    nothing reaps orphans (a container whose first process does not), signal 0 still reaches it: its
    state in /proc says it is dead.

    >>> alive(os.getpid())
    True
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user (a reused pid would be too)
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no /proc (not Linux), or it ended just now
        return not Path("/proc").is_dir()
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")  # after the command name, the state


def write_status(code: int, error: str) -> None:
    """Called by the training process on a user error: the supervisor reads it (first writer wins)."""
    path = os.environ.get(STATUS_ENV)
    if not path:
        return
    try:
        with open(path, "x", encoding="utf-8") as f:  # "x": the first process to fail is the one told
            json.dump({"exit": code, "error": error}, f)
    except OSError:
        pass


def run_supervised(cmd: list[str], env: dict[str, str] | None = None) -> int:
    """Run `cmd` (the launcher); forward stop signals to the training processes; return the exit code,
    2 when training stopped on a user error (its message already printed, the launcher's traceback not)."""
    with tempfile.TemporaryDirectory(prefix="finetune-train-") as tmp:
        status = Path(tmp) / "status.json"
        env = {
            **(env if env is not None else os.environ),
            STATUS_ENV: str(status),
            SUPERVISOR_ENV: str(os.getpid()),
        }
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, start_new_session=True)
        signals = _Forwarder(proc)
        shown: list[bytes] = []
        relay = threading.Thread(target=_relay_stderr, args=(proc.stderr, status, shown), daemon=True)
        relay.start()
        try:
            code = proc.wait()
        finally:
            signals.restore()
        relay.join(timeout=5)
        if status.is_file():
            report = json.loads(status.read_text())
            line = f"error: {report.get('error', '')}"
            relayed = b"".join(shown)
            if line.encode() not in relayed:  # the relay dropped it with what followed
                # ... and maybe the newline before it: the last bytes relayed can be a progress bar's
                # last draw (no newline), and the error starts a line of its own.
                lead = "\n" if relayed and not relayed.endswith(b"\n") else ""
                print(lead + line, file=sys.stderr, flush=True)
            return int(report.get("exit", 2))
        if code == -signal.SIGTERM and signals.launcher_only and signals.count == 1:
            # Stopped before the launcher had started training: nothing trained, nothing to save.
            print(
                "finetune train: stopped before training started; nothing to save",
                file=sys.stderr,
                flush=True,
            )
            return 0
        if code < 0 and signals.received is not None:  # killed by the forwarded signal's second round
            return 128 + signals.received
        return code


def _relay_stderr(stream, status: Path, shown: list[bytes]) -> None:
    """Copy the launcher's stderr (and the training processes', which share it) to ours as it comes,
    until training has reported a user error: what follows is the launcher's traceback about it.
    The last forwarded bytes are kept in `shown`."""
    out = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
    while chunk := os.read(stream.fileno(), 65536):
        if status.is_file():
            continue  # keep draining, so the launcher never blocks on a full pipe
        shown.append(chunk)
        del shown[:-16]
        if out is not None:
            out.write(chunk)
            out.flush()
        else:
            sys.stderr.write(chunk.decode("utf-8", errors="replace"))


class _Forwarder:
    """Signal handlers for the supervisor's lifetime: the first stop signal goes to the training
    processes (the launcher's descendants), the second to the launcher's whole session."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.received, self.count = proc, None, 0
        self.launcher_only = False  # the first signal came before the launcher had started training
        self.previous = {sig: signal.signal(sig, self._handle) for sig in FORWARDED}

    def _handle(self, signum, frame) -> None:
        self.received, self.count = signum, self.count + 1
        if self.count == 1:
            targets = _descendants(self.proc.pid)
            print(
                f"finetune train: {signal.Signals(signum).name}: asking training to checkpoint and stop "
                "(again to stop at once)",
                file=sys.stderr,
                flush=True,
            )
            if not targets:  # the launcher is still starting: SIGTERM ends it without a traceback
                self.launcher_only = True
                _kill(self.proc.pid, signal.SIGTERM)
            for pid in targets:
                _kill(pid, signal.SIGTERM if signum == signal.SIGHUP else signum)
        else:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _descendants(pid: int) -> list[int]:
    try:
        import psutil

        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except Exception:  # psutil missing or the process already gone: signal the launcher instead
        return []


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)
