"""Image sources -> records (image location + caption), with every unusable row accounted for.

* `images`, local folder: captions from `metadata.jsonl` or `metadata.csv` at the folder root
  (`file_name` + `diffusion.caption_column`, the layout of datasets' imagefolder), else from a `.txt`
  file next to each image.
* `dreambooth`, local folder: every image gets `diffusion.instance_prompt`.
* Hub dataset ids (either type): `datasets.load_dataset` with `diffusion.image_column` (bytes kept
  undecoded, so EXIF handling and drops happen here) and the caption column.
* Class images for prior preservation: the first `num_class_images` images of `class_data_dir`.

A row without a caption, or a metadata row naming a missing file, follows `data.on_bad_row` (raise
with the file and the fix, or skip and count). Unreadable and too-small images are counted when the
cache is built (cache.py).
"""

from __future__ import annotations

import csv
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.data.sources.location import file_hash, looks_local, source_fingerprint
from finetune.diffusion.images import IMAGE_SUFFIXES
from finetune.errors import DataError

METADATA_FILES = ("metadata.jsonl", "metadata.csv")


@dataclass(frozen=True)
class ImageRecord:
    """One training image: where it is, its caption, and which source it came from."""

    source: str  # e.g. data.datasets[0] or class_data_dir
    key: str  # relative file name, or `row <i>` for Hub rows
    caption: str
    path: Path | None = None
    data: bytes | None = None  # Hub images arrive as bytes
    is_prior: bool = False

    def read(self) -> str | Path | bytes:
        return self.data if self.data is not None else self.path


@dataclass
class SourceRecords:
    """The records of one source and what was left out (reason -> count, plus a few examples)."""

    label: str
    path: str
    type: str
    records: list[ImageRecord]
    rows_in: int
    dropped: Counter = field(default_factory=Counter)
    bad_rows: list[dict] = field(default_factory=list)


def list_images(folder: Path) -> list[Path]:
    """Image files under `folder` (recursive, hidden files and folders skipped), sorted."""
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file()
        and p.suffix.lower() in IMAGE_SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )


def folder_fingerprint(folder: Path, *, captions: bool) -> dict:
    """Content hashes of what a folder source reads: its images and (when `captions`) caption files.

    Other files (notes, .DS_Store) do not change the prepared data, so they are not hashed.
    """
    files = list_images(folder)
    if captions:
        files += [folder / name for name in METADATA_FILES if (folder / name).is_file()]
        files += [p.with_suffix(".txt") for p in list_images(folder) if p.with_suffix(".txt").is_file()]
    return {
        "kind": "local_dir",
        "files": {p.relative_to(folder).as_posix(): file_hash(p) for p in sorted(files)},
    }


def entry_fingerprint(entry: Any) -> dict:
    """What identifies a dataset entry's content: file hashes (local) or the Hub commit."""
    local = Path(entry.path).expanduser()
    if local.is_dir():
        return folder_fingerprint(local, captions=entry.type == "images")
    if local.exists():
        raise DataError(
            f"{entry.path}: an image source is a folder of images (or a Hub dataset id), not a file"
        )
    if looks_local(entry.path):
        raise DataError(f"{entry.path!r} does not exist (resolved to {local.resolve()})")
    return source_fingerprint(entry)


def load_entry(entry: Any, label: str, settings: Any, on_bad_row: str) -> SourceRecords:
    """The records of one `data.datasets` entry (see the module docstring for the layouts)."""
    local = Path(entry.path).expanduser()
    if local.is_dir():
        if entry.type == "dreambooth":
            images = list_images(local)
            records = [_record(label, local, p, settings.instance_prompt) for p in images]
            result = SourceRecords(label, entry.path, entry.type, records, rows_in=len(images))
        else:
            result = _load_captioned_folder(local, label, settings.caption_column, on_bad_row)
    else:
        entry_fingerprint(entry)  # raises the clear error for files and missing local paths
        result = _load_hub(entry, label, settings, on_bad_row)
    if not result.records and not result.dropped:
        raise DataError(
            f"{label}: no images found in {entry.path} (looked for {', '.join(sorted(IMAGE_SUFFIXES))})"
        )
    return result


def load_class_images(folder: Path, prompt: str, limit: int) -> SourceRecords:
    """Prior-preservation records: the first `limit` images of the class folder, all with `prompt`."""
    images = list_images(folder)[:limit]
    records = [_record("diffusion.class_data_dir", folder, p, prompt, is_prior=True) for p in images]
    return SourceRecords("diffusion.class_data_dir", str(folder), "class", records, rows_in=len(images))


def _record(label: str, root: Path, path: Path, caption: str, is_prior: bool = False) -> ImageRecord:
    return ImageRecord(label, path.relative_to(root).as_posix(), caption, path=path, is_prior=is_prior)


def _load_captioned_folder(folder: Path, label: str, column: str, on_bad_row: str) -> SourceRecords:
    images = list_images(folder)
    present = [name for name in METADATA_FILES if (folder / name).is_file()]
    if len(present) > 1:
        raise DataError(f"{label}: {folder} has both {present[0]} and {present[1]}; keep one caption file")
    out = SourceRecords(label, str(folder), "images", [], rows_in=0)

    def bad(key: str, reason: str, detail: str, fix: str) -> None:
        if on_bad_row == "raise":
            raise DataError(f"{label}: {detail}. {fix} (or set data.on_bad_row: skip to drop such rows)")
        out.dropped[reason] += 1
        if len(out.bad_rows) < 20:
            out.bad_rows.append({"source": label, "key": key, "reason": reason, "detail": detail})

    if not present:  # .txt sidecars
        out.rows_in = len(images)
        for path in images:
            sidecar = path.with_suffix(".txt")
            key = path.relative_to(folder).as_posix()
            caption = sidecar.read_text(encoding="utf-8").strip() if sidecar.is_file() else ""
            if not caption:
                bad(
                    key,
                    "no_caption",
                    f"{path} has no caption ({sidecar.name} is missing or empty)",
                    f"write its caption to {sidecar}, or add a metadata.jsonl with file_name and {column}",
                )
                continue
            out.records.append(_record(label, folder, path, caption))
        return out

    metadata = folder / present[0]
    rows = _read_metadata(metadata, label)
    by_name = {p.relative_to(folder).as_posix(): p for p in images}
    listed = {str(row.get("file_name") or "") for _, row in rows}
    # Every metadata row, plus every image no row names, is kept or dropped exactly once.
    out.rows_in = len(rows) + sum(1 for name in by_name if name not in listed)
    for line, row in rows:
        name = str(row.get("file_name") or "")
        where = f"{metadata.name} row {line}"
        if not name:
            bad(where, "no_file_name", f"{metadata} row {line} has no file_name", "add the image's file_name")
            continue
        caption = row.get(column)
        if name not in by_name:
            bad(name, "missing_file", f"{metadata} row {line} names {name}, which is not an image in {folder}",
                "fix the file_name or add the image")  # fmt: skip
        elif not isinstance(caption, str) or not caption.strip():
            available = ", ".join(k for k in row if k != "file_name") or "none"
            bad(name, "no_caption", f"{where} ({name}) has no text in column {column!r} (columns: {available})",
                "fill it in, or set diffusion.caption_column to the caption column")  # fmt: skip
        else:
            out.records.append(_record(label, folder, by_name[name], caption.strip()))
    for name in by_name:
        if name not in listed:
            bad(name, "no_caption", f"{folder / name} is not listed in {metadata.name}",
                f"add a row with file_name {name!r} and its {column}")  # fmt: skip
    return out


def _read_metadata(path: Path, label: str) -> list[tuple[int, dict]]:
    """(line number, row) of metadata.jsonl / metadata.csv; a malformed line is an error naming it."""
    rows = []
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".csv":
        reader = csv.DictReader(text.splitlines())
        if not reader.fieldnames or "file_name" not in reader.fieldnames:
            raise DataError(f"{label}: {path} needs a header row with a file_name column")
        return [(i + 2, row) for i, row in enumerate(reader)]
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{label}: {path} line {i} is not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"{label}: {path} line {i} is not a JSON object")
        rows.append((i, row))
    return rows


def _load_hub(entry: Any, label: str, settings: Any, on_bad_row: str) -> SourceRecords:
    """A Hub image dataset: rows -> records holding the encoded image bytes."""
    import datasets

    try:
        ds = datasets.load_dataset(entry.path, entry.name, split=entry.split, revision=entry.revision)
    except Exception as exc:
        raise DataError(
            f"{label}: cannot load {entry.path!r} from the Hub: {type(exc).__name__}: {exc}"
        ) from exc
    image_column, caption_column = settings.image_column, settings.caption_column
    needed = [image_column] + ([caption_column] if entry.type == "images" else [])
    missing = [c for c in needed if c not in ds.column_names]
    if missing:
        raise DataError(
            f"{label}: {entry.path} has no column {missing[0]!r} (columns: {', '.join(ds.column_names)}); set "
            f"diffusion.{'image_column' if missing[0] == image_column else 'caption_column'}"
        )
    if isinstance(ds.features[image_column], datasets.Image):
        ds = ds.cast_column(image_column, datasets.Image(decode=False))
    out = SourceRecords(label, entry.path, entry.type, [], rows_in=len(ds))
    for i, row in enumerate(ds.select_columns(needed)):
        image = row[image_column]
        data = image.get("bytes") if isinstance(image, dict) else None
        if data is None and isinstance(image, dict) and image.get("path"):
            data = Path(image["path"]).read_bytes()
        caption = settings.instance_prompt if entry.type == "dreambooth" else row.get(caption_column)
        reason = (
            "no_image"
            if data is None
            else "no_caption"
            if not isinstance(caption, str) or not caption.strip()
            else None
        )
        if reason:
            detail = f"{entry.path} row {i} has no {'image bytes' if reason == 'no_image' else 'caption'}"
            if on_bad_row == "raise":
                raise DataError(f"{label}: {detail} (set data.on_bad_row: skip to drop such rows)")
            out.dropped[reason] += 1
            if len(out.bad_rows) < 20:
                out.bad_rows.append({"source": label, "key": f"row {i}", "reason": reason, "detail": detail})
            continue
        out.records.append(ImageRecord(label, f"row {i}", caption.strip(), data=data))
    return out
