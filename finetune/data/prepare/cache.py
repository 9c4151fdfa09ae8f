"""The prepared-data cache shared by the text (finetune.data.prepare.build) and image (finetune.diffusion.cache)
prepare steps: fingerprints, complete folders, atomic writes, the lock, stale-folder cleanup.

Layout: `<dataset_prepared_path>/<fingerprint>/` holds the splits (`train/`, `eval/`, datasets saved
with save_to_disk) and `manifest.json`, written last. Safety:

* Atomic: a preparation is written to `<prepared>/.tmp-<fingerprint>-<pid>/`, `manifest.json` last,
  then renamed to `<fingerprint>/`. A folder without `manifest.json` is never loaded.
* One writer: a `filelock.FileLock` on `<prepared>/<fingerprint>.lock` (no timeout) makes a second
  process wait for the first and then load its result instead of preparing it again.
* Crashes: temporary folders whose lock nobody holds are stale and are removed on the next run.

Test hook: `FINETUNE_PREPARE_PAUSE_S=<seconds>` pauses inside the write (after `train/` is saved
into the temporary folder, before the manifest), printing `finetune-prepare: paused` to stderr,
until the time is up or a file named `resume` appears in the temporary folder. Tests use it to
kill a run mid-write, or to hold the lock while a second process starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from filelock import FileLock, Timeout

if TYPE_CHECKING:
    import datasets
from finetune.errors import write_error, write_failure_reason
from finetune.notices import hold_for_test

MANIFEST_NAME = "manifest.json"
FINGERPRINT_CHARS = 16  # of the sha256 hex digest: folder and Hub config name
PAUSE_ENV = "FINETUNE_PREPARE_PAUSE_S"
_PARALLEL_SAVE_BYTES = 256 * 2**20


@dataclass
class Prepared:
    """A prepared dataset: where it is, its splits and its manifest.

    `source` says how this call got it: "built" (prepared now), "cache" (found on disk) or "hub"
    (pulled from data.push_dataset_to_hub).
    """

    path: Path
    train: datasets.Dataset
    eval: datasets.Dataset | None
    manifest: dict
    source: str = "cache"


def cached_or_built(
    root: Path,
    fingerprint: str,
    *,
    build: Callable[[], Prepared],
    log: Callable[[str], None],
    what: str = "dataset",
    pull: Callable[[], Prepared | None] | None = None,
) -> Prepared:
    """The complete preparation `root/fingerprint`, else (under its lock) pulled or built.

    Another process may finish it while this one waits for the lock; it is then loaded, not built
    again. What crashed runs left behind is removed first.
    """
    prepared = load_complete(root / fingerprint)
    if prepared is not None:
        return prepared
    root.mkdir(parents=True, exist_ok=True)
    log(f"preparing {what} {fingerprint} (waiting for the lock if another process prepares it)")
    with FileLock(root / f"{fingerprint}.lock"):
        prepared = load_complete(root / fingerprint)
        if prepared is None:
            remove_stale(root, fingerprint)
            prepared = pull() if pull is not None else None
            if prepared is None:
                prepared = build()
    return prepared


def compute_fingerprint(inputs: dict) -> str:
    """sha256 of the canonical JSON of `inputs` (sorted keys, no whitespace), shortened.

    >>> compute_fingerprint({"b": 1, "a": [1, 2]}) == compute_fingerprint({"a": [1, 2], "b": 1})
    True
    """
    return hashlib.sha256(canonical_json(inputs).encode()).hexdigest()[:FINGERPRINT_CHARS]


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def load_complete(path: Path, source: str = "cache") -> Prepared | None:
    """The prepared dataset in `path`, or None when it is absent or has no manifest (incomplete)."""
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        return None
    import datasets  # here: finding a preparation (finetune.data.prepare.fingerprint.cached) does not need it

    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    train = datasets.load_from_disk(str(path / "train"))
    eval_ds = datasets.load_from_disk(str(path / "eval")) if (path / "eval").is_dir() else None
    return Prepared(path=path, train=train, eval=eval_ds, manifest=manifest, source=source)


def complete_dirs(root: Path) -> list[Path]:
    """The complete preparations under `root`."""
    if not root.is_dir():
        return []
    return [
        p
        for p in root.iterdir()
        if p.is_dir() and not p.name.startswith(".") and (p / MANIFEST_NAME).is_file()
    ]


def remove_stale(root: Path, fingerprint: str) -> None:
    """Delete what crashed runs left behind. Called with the lock of `fingerprint` held.

    Our fingerprint's temporary folders and an incomplete `<fingerprint>/` cannot belong to a live
    writer (it would hold the lock). Other fingerprints' temporary folders are removed only when
    their lock can be taken at once, i.e. nobody is writing them.
    """
    final = root / fingerprint
    if final.exists() and not (final / MANIFEST_NAME).is_file():
        shutil.rmtree(final, ignore_errors=True)
    for tmp in root.glob(".tmp-*"):
        other = tmp.name.removeprefix(".tmp-").rsplit("-", 1)[0]
        if other == fingerprint:
            shutil.rmtree(tmp, ignore_errors=True)
            continue
        lock = FileLock(root / f"{other}.lock", blocking=False)
        try:
            with lock:
                shutil.rmtree(tmp, ignore_errors=True)
        except Timeout:
            pass  # being written right now


def write_atomically(
    root: Path,
    fingerprint: str,
    splits: dict[str, datasets.Dataset],
    manifest: dict,
    *,
    num_proc: int,
    num_shards: int | None,
    started: float | None = None,
) -> None:
    """Save splits and manifest (last) into a temporary folder, then rename it into place.

    `started` (a perf_counter value) sets manifest timings.total to the time since then.
    """
    start = time.perf_counter()
    tmp = root / f".tmp-{fingerprint}-{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name, ds in splits.items():
            shards = min(num_shards, len(ds)) if num_shards else None
            # Worker processes cost ~1 s to start: only worth it for large splits.
            procs = min(num_proc, shards or num_proc) if ds.data.nbytes > _PARALLEL_SAVE_BYTES else 1
            ds.save_to_disk(str(tmp / name), num_shards=shards, num_proc=procs if procs > 1 else None)
            if name == "train":
                _test_pause(tmp)
        now = time.perf_counter()
        manifest["timings"]["save"] = round(now - start, 4)
        if started is not None:
            manifest["timings"]["total"] = round(now - started, 4)
        text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
        (tmp / MANIFEST_NAME).write_text(text, encoding="utf-8")
        os.rename(tmp, root / fingerprint)
    except BaseException as exc:
        # A half-written preparation would keep its disk space until the next prepare of this
        # fingerprint; it goes now, whatever stopped the write.
        shutil.rmtree(tmp, ignore_errors=True)
        if write_failure_reason(exc) is None:
            raise
        raise write_error(
            exc,
            f"writing the prepared dataset {fingerprint} in {root}",
            root,
            "The partial folder was removed and nothing else changed; free space, or choose another "
            "data.dataset_prepared_path, then prepare again",
        ) from None


def _test_pause(tmp: Path) -> None:
    hold_for_test("prepare", float(os.environ.get(PAUSE_ENV) or 0), release=tmp / "resume")


def library_versions(*extra: str) -> dict:
    """Versions of Python and the libraries a preparation depends on (plus `extra` packages)."""
    out = {"python": platform.python_version()}
    for name in ("finetune", "datasets", "transformers", "tokenizers", "pyarrow", "numpy", *extra):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out
