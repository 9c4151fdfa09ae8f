"""The GGUF conversion cache on a bad day: damaged conversions heal, a full disk is a clear error with
nothing left behind, folders and files are readable by the cache's other users, and temporary
folders of killed conversions are cleaned up. Conversions are real, of the tiny GGUF file
(tests/tiny.py tiny_gguf)."""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import stat
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM

import finetune.gguf.convert
from finetune.errors import FinetuneError
from finetune.gguf.convert import MARKER_NAME, cache_damage, converted_folder, remove_stale_temp_folders


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock"))


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    # Copied: the loaded tensors map the file, which the tests then damage.
    return {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(folder).state_dict().items()}


def _truncate(folder: Path) -> None:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_a_byte(folder: Path) -> None:
    """One byte of the last weight rewritten in place: the size stays, the content (and time) change."""
    path = folder / "model.safetensors"
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


def _garble_marker(folder: Path) -> None:
    (folder / MARKER_NAME).write_text("{not json")


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (_truncate, r"model\.safetensors has \d+ bytes, the conversion wrote \d+"),
        (_flip_a_byte, r"model\.safetensors was changed after the conversion"),
        (lambda folder: (folder / "config.json").unlink(), r"config\.json is missing"),
        (_garble_marker, r"its marker \.finetune-gguf\.json is unreadable"),
    ],
    ids=["truncated-weights", "flipped-byte", "deleted-config", "garbled-marker"],
)
def test_a_damaged_conversion_is_reported_and_converted_again(
    tiny_gguf_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture, damage, said: str
) -> None:
    root = tmp_path / "cache"
    folder = converted_folder(tiny_gguf_file, root=root)
    original = _weights(folder)
    damage(folder)
    capsys.readouterr()
    assert converted_folder(tiny_gguf_file, root=root) == folder
    err = capsys.readouterr().err
    assert f"warning: the GGUF conversion {folder} is damaged: " in err
    assert re.search(said, err), err
    assert "converting tiny.gguf again" in err
    assert cache_damage(folder) is None and _leftovers(root) == [folder.name]
    healed = _weights(folder)
    assert all(torch.equal(healed[k], original[k]) for k in original)


def test_a_cache_hit_reads_no_weights(tiny_gguf_file: Path, tmp_path: Path) -> None:
    folder = converted_folder(tiny_gguf_file, root=tmp_path / "cache")
    marker = json.loads((folder / MARKER_NAME).read_text())
    assert set(marker["files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    with mock.patch.object(
        finetune.gguf.convert, "file_sha256", side_effect=AssertionError("hashed on a hit")
    ):
        assert cache_damage(folder) is None  # sizes and times only


def test_a_copied_cache_is_hashed_once_and_kept(tiny_gguf_file: Path, tmp_path: Path) -> None:
    """A copy without its times (cp -r) has the same bytes: it is hashed, kept, and its times recorded."""
    folder = converted_folder(tiny_gguf_file, root=tmp_path / "cache")
    later = time.time() + 60
    for path in folder.iterdir():
        os.utime(path, (later, later))
    with mock.patch.object(
        finetune.gguf.convert, "convert_gguf", side_effect=AssertionError("converted again")
    ):
        assert converted_folder(tiny_gguf_file, root=tmp_path / "cache") == folder
    with mock.patch.object(finetune.gguf.convert, "file_sha256", side_effect=AssertionError("hashed again")):
        assert cache_damage(folder) is None


def test_the_cache_is_readable_by_its_other_users(tiny_gguf_file: Path, tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        folder = converted_folder(tiny_gguf_file, root=tmp_path / "cache")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    assert modes and set(modes.values()) == {0o644}, modes
    assert cache_damage(folder) is None  # changing modes left the recorded times alone


def _dead_pid() -> int:
    """A pid no process has: above the kernel's largest (no child started: the fast tier starts none)."""
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


def test_temporary_folders_of_killed_conversions_are_removed(tiny_gguf_file: Path, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    host = socket.gethostname()
    dead = root / f".0123456789abcdef-v2.tmp-{host}-{_dead_pid()}-0badc0de"
    live = root / f".0123456789abcdef-v2.tmp-{host}-{os.getpid()}-0badc0de"
    other_host = root / f".0123456789abcdef-v2.tmp-elsewhere-{_dead_pid()}-0badc0de"
    old = root / ".0123456789abcdef-v1.tmp-k2j4h5g6"  # tempfile.mkdtemp's name, from an older finetune
    for path in (dead, live, other_host, old):
        path.mkdir()
    two_days_ago = time.time() - 2 * 24 * 3600
    os.utime(old, (two_days_ago, two_days_ago))
    folder = converted_folder(tiny_gguf_file, root=root)
    # A live process's folder and another host's (whose processes this host cannot see) are kept.
    assert _leftovers(root) == sorted([folder.name, live.name, other_host.name])
    assert remove_stale_temp_folders(root) == []


def _raise_from_the_writer(exc: BaseException):
    def save_file(*args, **kwargs):
        raise exc

    return mock.patch("transformers.modeling_utils.safe_save_file", save_file)


@pytest.mark.parametrize(
    "exc",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
        RuntimeError("failed to write: No space left on device (os error 28)"),
    ],
    ids=["OSError", "SafetensorError", "RuntimeError"],
)
def test_a_full_disk_is_a_clear_error_and_leaves_nothing(
    tiny_gguf_file: Path, tmp_path: Path, exc: BaseException
) -> None:
    root = tmp_path / "cache"
    with _raise_from_the_writer(exc), pytest.raises(FinetuneError) as raised:
        converted_folder(tiny_gguf_file, root=root)
    message = str(raised.value)
    assert f"no space left on the disk of the GGUF conversion cache {root}" in message
    assert "MB needed" in message and "MB free" in message and "FINETUNE_GGUF_CACHE" in message
    assert _leftovers(root) == []
    assert converted_folder(tiny_gguf_file, root=root).is_dir()  # with room again, it converts


def test_an_unrelated_bug_in_the_writer_is_not_called_a_disk_problem(
    tiny_gguf_file: Path, tmp_path: Path
) -> None:
    with _raise_from_the_writer(RuntimeError("a bug")), pytest.raises(RuntimeError, match="a bug"):
        converted_folder(tiny_gguf_file, root=tmp_path / "cache")
    assert _leftovers(tmp_path / "cache") == []
