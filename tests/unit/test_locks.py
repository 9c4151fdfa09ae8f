"""finetune.locks: a lock that names its holder; a record left by a dead holder is taken over."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.locks import LockHeld, OwnedLock, read_owner


def test_a_held_lock_names_its_holder_and_a_clean_release_removes_the_record(tmp_path: Path):
    first = OwnedLock(tmp_path / ".train")
    assert first.acquire() is None
    owner = read_owner(tmp_path / ".train.owner.json")
    assert owner["pid"] == os.getpid() and owner["host"] and owner["started"]
    with pytest.raises(LockHeld) as held:
        OwnedLock(tmp_path / ".train").acquire()
    assert held.value.owner == owner
    assert str(held.value) == f"pid {os.getpid()} on host {owner['host']}, started {owner['started']}"
    first.release()
    assert not (tmp_path / ".train.owner.json").exists()
    second = OwnedLock(tmp_path / ".train")
    assert second.acquire() is None  # a clean release leaves nothing to take over
    second.release()


@pytest.mark.slow  # a process killed with SIGKILL
def test_the_lock_of_a_killed_process_is_taken_over_with_its_record(tmp_path: Path):
    """A process that takes the lock and dies by SIGKILL: the OS frees the lock, its record stays."""
    script = (
        "import os, signal, sys; from pathlib import Path; from finetune.locks import OwnedLock; "
        f"OwnedLock(Path({str(tmp_path)!r}) / '.train').acquire(); os.kill(os.getpid(), signal.SIGKILL)"
    )
    dead = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2])
    assert dead.returncode == -9
    left = json.loads((tmp_path / ".train.owner.json").read_text())
    lock = OwnedLock(tmp_path / ".train")
    assert lock.acquire() == left  # taken over, and told whose it was
    assert read_owner(tmp_path / ".train.owner.json")["pid"] == os.getpid()
    lock.release()


def test_an_unreadable_record_is_no_record(tmp_path: Path):
    (tmp_path / ".train.owner.json").write_text('{"pid": 12, "ho')  # cut short
    assert read_owner(tmp_path / ".train.owner.json") == {}
    lock = OwnedLock(tmp_path / ".train")
    assert lock.acquire() is None
    lock.release()
