"""A lock on a folder that says who holds it: one writer at a time, and a clear word to the second.

The lock itself is filelock's `FileLock` (an OS lock, `flock`, on `<name>.lock`), the mechanism the
prepare step (finetune.data.prepare.cache) and the GGUF conversion (finetune.gguf) already wait on. The OS
releases it when its process dies, however it dies, so a killed run never blocks the next one. What
filelock lacks, and this module adds, is the holder's identity for the error message: once the lock is
held, `<name>.owner.json` records pid, host, start time and command line; it is removed on a clean
release. A record found while the lock is free is therefore a holder that died without releasing:
`acquire` takes the lock over and returns that record so the caller can say so.

>>> import tempfile, pathlib
>>> folder = pathlib.Path(tempfile.mkdtemp())
>>> first = OwnedLock(folder / ".train")
>>> first.acquire()  # None: nobody held it before
>>> try:
...     OwnedLock(folder / ".train").acquire()
... except LockHeld as held:
...     held.owner["pid"] == os.getpid()
True
>>> first.release()
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any


class LockHeld(Exception):
    """The lock is held by another live process; `owner` is its record ({} when not written yet)."""

    def __init__(self, owner: dict[str, Any]):
        super().__init__(describe_owner(owner))
        self.owner = owner


class OwnedLock:
    """`<base>.lock` (the OS lock) and `<base>.owner.json` (who holds it). Not reentrant."""

    def __init__(self, base: Path):
        from filelock import FileLock

        self.lock_path = base.with_name(base.name + ".lock")
        self.owner_path = base.with_name(base.name + ".owner.json")
        self._lock = FileLock(self.lock_path, blocking=False)

    def acquire(self) -> dict[str, Any] | None:
        """Take the lock without waiting. Raises LockHeld when another process holds it; returns the
        record of a holder that died without releasing it (taken over), else None."""
        from filelock import Timeout

        try:
            self._lock.acquire()
        except Timeout:
            raise LockHeld(read_owner(self.owner_path)) from None
        stale = read_owner(self.owner_path) or None
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "command": " ".join(sys.argv),
        }
        tmp = self.owner_path.with_name(f".{self.owner_path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=1), encoding="utf-8")
        os.replace(tmp, self.owner_path)  # a reader never sees half a record
        return stale

    def release(self) -> None:
        """Remove the owner record (a clean end), then release the OS lock."""
        if not self._lock.is_locked:
            return
        try:
            self.owner_path.unlink(missing_ok=True)
        finally:
            self._lock.release()


def read_owner(path: Path) -> dict[str, Any]:
    """The owner record at `path`; {} when absent or unreadable (being written, or damaged)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def describe_owner(owner: dict[str, Any]) -> str:
    """`pid 12 on host h, started 2025-01-01 10:00:00 +0000`, or what is known of it.

    >>> describe_owner({"pid": 12, "host": "h", "started": "2025-01-01 10:00:00 +0000"})
    'pid 12 on host h, started 2025-01-01 10:00:00 +0000'
    >>> describe_owner({})
    'a process that has not recorded itself yet'
    """
    if not owner:
        return "a process that has not recorded itself yet"
    return (
        f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}, started {owner.get('started', '?')}"
    )
