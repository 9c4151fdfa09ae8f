"""Exceptions for user errors: the CLI prints them without a traceback and exits with code 2."""

import contextlib
import errno


class FinetuneError(Exception):
    """A problem the user can fix (bad recipe, bad data, missing file)."""


class DataError(FinetuneError):
    """A dataset could not be loaded, formatted or prepared."""


class RecipeError(FinetuneError):
    """The recipe file or its overrides are invalid."""


class WriteError(FinetuneError):
    """Files could not be written (a full disk, a quota, a read-only or unwritable folder)."""


# How the writers finetune uses report a refused write when it is not an OSError: torch.save (and
# DeepSpeed, through it) raises RuntimeError("[enforce fail at inline_container.cc:672] . unexpected
# pos 576 vs 534") on a full disk, safetensors SafetensorError("Error while serializing: I/O error: No
# space left on device (os error 28)"). Matched on the text because that is all they carry.
_WRITE_FAILURE_TEXT = (
    "no space left",
    "storagefull",
    "os error",
    "i/o error",
    "file write failed",
    "inline_container.cc",
    "pytorchstreamwriter",
    "disk quota",
    "read-only file system",
    "permission denied",
)
_ERRNO_REASONS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EROFS: "the filesystem is read-only",
}


def write_failure_reason(exc: BaseException) -> str | None:
    """Why a write failed, in a few words, when `exc` is a writer's report of a refused write (a full
    disk, a quota, permissions); None for any other exception, which is a bug to show as it is.

    >>> write_failure_reason(OSError(28, "No space left on device"))
    'no space left on the device'
    >>> write_failure_reason(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"))
    'the write failed ([enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534)'
    >>> write_failure_reason(RuntimeError("size mismatch")) is None
    True
    """
    if isinstance(exc, OSError):
        return _ERRNO_REASONS.get(exc.errno or 0) or exc.strerror or str(exc)
    if not (isinstance(exc, RuntimeError) or type(exc).__name__ == "SafetensorError"):
        return None
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    lowered = text.lower()
    if not any(mark in lowered for mark in _WRITE_FAILURE_TEXT):
        return None
    if "no space left" in lowered or "os error 28" in lowered:
        return "no space left on the device"
    return f"the write failed ({text})"


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc` reports a full disk or an exhausted quota (rather than another refused write).

    >>> is_disk_full(OSError(28, "No space left on device"))
    True
    >>> is_disk_full(RuntimeError("Error while serializing: I/O error: StorageFull"))
    True
    >>> is_disk_full(PermissionError(13, "Permission denied"))
    False
    """
    if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc).lower()
    return any(
        s in text for s in ("no space left on device", "os error 28", "storagefull", "disk quota exceeded")
    )


def write_error(exc: BaseException, doing: str, folder, fix: str) -> WriteError:
    """The WriteError for a failed write that `write_failure_reason` recognised: what was being done,
    why it failed, the free space left on `folder`'s disk, and `fix`."""
    import shutil
    from pathlib import Path

    reason = write_failure_reason(exc)
    where = getattr(exc, "filename", None) or folder
    free = ""
    probe = Path(folder)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    with contextlib.suppress(OSError):
        free = f"; {shutil.disk_usage(probe).free / 2**20:,.0f} MiB free on that disk"
    return WriteError(f"{doing}: {reason} ({where}{free}). {fix}")
