"""Read a dataset entry's raw rows, as a Dataset (`load_source`) or as a stream (`load_stream`).

Where ``entry.path`` points is finetune.data.sources.location's `locate` (checked in this order):

* an fsspec URL (``s3://``, ``gs://``, ``https://``, ``file://``, ...): data file(s) read by the
  builder of ``ds_type`` or of the file extension, or a ``save_to_disk`` directory when neither
  gives a format;
* a local ``save_to_disk`` directory (``load_from_disk``; for a DatasetDict, ``split`` picks one);
* a local directory of data files (``data_files`` inside it, or every data file it holds, with
  the split names taken from the file names as ``datasets`` does);
* a local file (json, jsonl, csv, tsv, parquet, arrow, txt; compressed ones too);
* otherwise a Hugging Face Hub dataset id (``load_dataset(path, name, split=, revision=)``).

``shards`` / ``shards_idx`` then keep one contiguous shard. Every failure is a DataError naming
the entry and the path. When local files can't be loaded, finetune/data/sources/damage.py finds the
damaged file, line and byte; with ``on_bad_row="skip"`` damaged rows are loaded as placeholders
marked in the ``damage.BAD_ROW_COLUMN`` column, which tokenization counts as bad rows.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
from datasets.fingerprint import Hasher
from datasets.utils.json import get_json_field_paths_from_feature

from finetune.data.sources import damage
from finetune.data.sources.location import (
    BUILDERS,
    COMPRESSION_EXTENSIONS,
    EXTENSION_TO_BUILDER,
    Location,
    file_hash,
    file_list,
    local_dir_files,
    locate,
)
from finetune.errors import DataError
from finetune.notices import warn

logger = logging.getLogger(__name__)


def load_source(
    entry: Any,
    *,
    num_proc: int | None = None,
    entry_label: str = "data.datasets[0]",
    on_bad_row: str = "raise",
) -> datasets.Dataset:
    """The rows of ``entry`` (one split), before any formatting or tokenization.

    A damaged row of a local file (invalid JSON, bytes that are not UTF-8, a CSV row with too many
    fields) raises a DataError naming the file, line and byte, or with ``on_bad_row="skip"`` is
    loaded as a placeholder row marked in ``damage.BAD_ROW_COLUMN`` (see damage.py).
    """
    where = locate(entry)
    if where.kind == "url":
        ds = _load_url(entry, where, num_proc, entry_label)
    elif where.kind == "missing":
        raise DataError(_missing(entry.path, entry_label))
    elif where.kind == "hub":
        ds = _load_hub(entry, num_proc, entry_label)
    else:
        ds = _load_local(entry, where, num_proc, entry_label, on_bad_row)
    if entry.shards:
        index = entry.shards_idx or 0
        if not 0 <= index < entry.shards:
            raise DataError(f"{entry_label}: shards_idx {index} must be in 0..{entry.shards - 1}")
        ds = ds.shard(num_shards=entry.shards, index=index, contiguous=True)
    return ds


def _missing(path: str, label: str) -> str:
    """The error for a local path where nothing is."""
    return (
        f"{label}: {path!r} does not exist (resolved to {os.path.abspath(os.path.expanduser(path))}). "
        f"Check {label}.path; relative paths are taken from the current directory."
    )


def _unknown_format(path: Any, label: str) -> str:
    """The error for a local file whose extension names no builder."""
    return (
        f"{label}: can't tell the format of {path} from its extension; set {label}.ds_type to one of "
        f"{', '.join(BUILDERS)}"
    )


# -------------------------------------------------------------------------------------------- loading


def _load_local(
    entry: Any, where: Location, num_proc: int | None, label: str, on_bad_row: str
) -> datasets.Dataset:
    path, builder = Path(entry.path).expanduser(), where.builder
    if where.kind == "saved_dataset":
        if entry.data_files:
            raise DataError(
                f"{label}: {path} is a save_to_disk directory; remove data_files (it has no files to pick)"
            )
        return _from_disk(str(path), entry, label)
    if where.kind == "local_dir":
        _check_has_data_files(path, entry, label)
        if builder:
            kwargs = {"data_dir": str(path), "data_files": entry.data_files, **where.options}
            return _load_dataset(builder, entry, label, on_bad_row, num_proc=num_proc, **kwargs)
        return _load_dataset(str(path), entry, label, on_bad_row, num_proc=num_proc)
    if entry.data_files:
        raise DataError(
            f"{label}: data_files needs path to be a directory or a Hub dataset, but {path} is a file; "
            "put the file in path and remove data_files"
        )
    if builder is None:
        raise DataError(_unknown_format(path, label))
    if path.stat().st_size == 0:
        raise DataError(f"{label}: {path} is empty (0 bytes). Point {label}.path at a file with rows.")
    kwargs = {"data_files": str(path), **where.options}
    return _load_dataset(builder, entry, label, on_bad_row, num_proc=num_proc, **kwargs)


def _load_url(entry: Any, where: Location, num_proc: int | None, label: str) -> datasets.Dataset:
    url = entry.path
    check_filesystem(url, label)
    if where.builder is None:
        # Not a data file by its name: a dataset written with save_to_disk to remote storage.
        return _from_disk(url, entry, label)
    data_files = _url_files(entry)
    kwargs = {"data_files": data_files, **where.options}
    return _load_dataset(where.builder, entry, label, None, num_proc=num_proc, **kwargs)


def _url_files(entry: Any) -> str | list[str]:
    """The data files of a URL entry: its data_files under the URL, else the URL itself."""
    files = file_list(entry.data_files)
    return [f"{entry.path.rstrip('/')}/{f}" for f in files] if files else entry.path


# fsspec imports a URL scheme's filesystem from another package, and only when such a URL is read.
FILESYSTEM_PACKAGES = {
    "http": "aiohttp",
    "https": "aiohttp",
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
}


def check_filesystem(url: str, label: str) -> None:
    """Before an fsspec URL is read: its scheme's filesystem can be imported, else a DataError naming
    the package to install (rather than fsspec's ImportError from deep inside datasets' loading)."""
    import fsspec

    scheme = url.split("://", 1)[0].lower()
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as e:
        package = FILESYSTEM_PACKAGES.get(scheme, f"fsspec's {scheme} implementation")
        extra = " (or pip install 'finetune[remote]')" if package == "aiohttp" else ""
        raise DataError(
            f"{label}: reading {url!r} needs fsspec's {scheme}:// filesystem, which is not installed ({e}): "
            f"pip install {package}{extra}"
        ) from None
    except ValueError:
        raise DataError(
            f"{label}: {url!r} has a URL scheme fsspec does not know ({scheme}://); use a local path, a Hub "
            "dataset id, or an https://, s3://, gs:// URL"
        ) from None


def _load_hub(entry: Any, num_proc: int | None, label: str) -> datasets.Dataset:
    if entry.trust_remote_code:
        warn(
            f"{label}: trust_remote_code is ignored: datasets {datasets.__version__} no longer runs dataset "
            f"loading scripts (it loads the data files of {entry.path} directly)"
        )
    return _load_dataset(
        entry.path,
        entry,
        label,
        None,
        num_proc=num_proc,
        name=entry.name,
        data_files=entry.data_files,
        revision=entry.revision,
    )


def _load_dataset(
    path_or_builder: str, entry: Any, label: str, on_bad_row: str | None, **kwargs: Any
) -> datasets.Dataset:
    """``datasets.load_dataset`` with its failures explained; ``on_bad_row`` None: not local files."""
    try:
        ds = datasets.load_dataset(path_or_builder, split=entry.split, **kwargs)
    except FileNotFoundError as e:
        raise DataError(
            f"{label}: file not found for {entry.path!r}: {e}. Check {label}.path and data_files."
        ) from e
    except ValueError as e:
        if "Unknown split" in str(e):
            raise DataError(
                f"{label} ({entry.path}): split {entry.split!r} does not exist: {e} Set {label}.split."
            ) from e
        return _load_damaged(path_or_builder, entry, label, on_bad_row, kwargs, e)
    except ConnectionError as e:
        raise DataError(
            f"{label}: {entry.path!r} is not a local path, and the Hugging Face Hub could not be reached to "
            f"load it as a dataset id ({e}). Fix the path, or check the network and HF_ENDPOINT / HF_HUB_OFFLINE."
        ) from e
    except Exception as e:  # bad JSON/CSV, unreadable parquet, empty files: found by damage.scan
        return _load_damaged(path_or_builder, entry, label, on_bad_row, kwargs, e)
    if ds.info.builder_name == "json" and not _valid_utf8(ds):
        if on_bad_row is None:
            raise DataError(
                f"{label}: {entry.path!r} holds bytes that are not UTF-8; data files must be UTF-8"
            )
        return _load_damaged(path_or_builder, entry, label, on_bad_row, kwargs, None)
    if ds.info.builder_name == "json" and get_json_field_paths_from_feature(ds.features):
        resolved = _resolved_files(path_or_builder, entry, kwargs)
        files = resolved[1] if resolved else []
        return _strings_kept(ds, files, entry, label, {k: kwargs[k] for k in ("num_proc",) if kwargs.get(k)})
    return ds


def _valid_utf8(ds: datasets.Dataset) -> bool:
    """Whether every string of ``ds`` is valid UTF-8.

    pyarrow's JSON reader copies string bytes without checking them (the CSV and text builders
    decode, so they fail at load time instead), and a bad byte would surface as a
    UnicodeDecodeError traceback in the middle of tokenization. One pass in C++ over the loaded
    columns (about 10 GB/s) costs next to nothing beside tokenizing them.
    """
    try:
        ds.data.table.validate(full=True)
    except pa.ArrowInvalid as e:
        return "UTF8" not in str(e)
    return True


def _check_has_data_files(path: Path, entry: Any, label: str) -> None:
    """A directory with no data file (or none matching data_files) gets an error saying so: datasets
    would guess another loader for it and report something unrelated."""
    try:
        found = local_dir_files(path, entry)
    except DataError as e:
        raise DataError(f"{label}: data_files not found: {e}. Check {label}.data_files.") from e
    if not found:
        raise DataError(_no_data_files(entry, label))


def _no_data_files(entry: Any, label: str) -> str:
    names = ", ".join(sorted(EXTENSION_TO_BUILDER))
    return (
        f"{label}: the directory {entry.path} holds no data files (files ending in {names}, optionally "
        f"compressed). Put the data there, or name the files with {label}.data_files and their format "
        f"with {label}.ds_type."
    )


# ------------------------------------------------------------------------ columns of mixed JSON types

# Bump when the encoded copies change: they are named with it (see _encoded_copy).
ENCODED_COPY_VERSION = 1


def _strings_kept(
    ds: datasets.Dataset,
    files: list[str],
    entry: Any,
    label: str,
    extra: dict[str, Any],
    *,
    split: str | None = None,
) -> datasets.Dataset:
    """``ds`` again, with every string of its mixed-type JSON columns read back as that string.

    datasets' json builder stores a column that mixes types (strings in some rows, lists of
    messages or objects in others) as its ``Json`` feature: JSON text per value, decoded on read.
    It encodes each value with ``json_encode_field``, which keeps a string that already parses as
    JSON as it is, so the answer ``"42"`` is read back as the number 42, ``"null"`` as None and
    ``"[1, 2]"`` as a list: a string can't be told from the JSON it spells. datasets has no
    option that keeps them apart (``on_mixed_types=None`` fails on such a column, and a given
    ``features=`` goes through the same encoding), so the files are copied with every value of
    those columns written as its JSON text (``"42"`` -> ``"\\"42\\""``), which datasets keeps as
    it is and decodes back to the string, and the copies are loaded with the same features.
    Only data with such a column pays for the copy (one pass in Python over its files).
    """
    paths = get_json_field_paths_from_feature(ds.features)
    if not paths:
        return ds
    names = sorted({".".join(str(p) for p in path if p != 0) for path in paths})
    if not files or not all(Path(f).is_file() for f in files):
        warn(
            f"{label}: the column(s) {names} of {entry.path!r} mix strings with lists or objects, and datasets "
            'reads such a string that is valid JSON as what it spells ("42" as 42, "null" as null); only '
            "local files can be read again to keep them strings: download the files and point "
            f"{label}.path at them, or give each column one type"
        )
        return ds
    logger.info("%s: reading the mixed-type JSON column(s) %s again to keep their strings", label, names)
    copies = [str(_encoded_copy(f, paths)) for f in files]
    split_name = split or _base_split(entry.split)
    return datasets.load_dataset(
        "json",
        data_files={split_name: copies},
        split=split or entry.split,
        features=ds.features,
        **extra,
    )


def _encoded_copy(path: str, paths: list[list[Any]]) -> Path:
    """A JSON lines copy of ``path`` with the values at ``paths`` written as their JSON text, in the
    datasets cache, named by the file's content and the paths (an existing copy is reused)."""
    name = Path(path).name
    for ext in COMPRESSION_EXTENSIONS:
        name = name.removesuffix(ext)
    key = Hasher.hash([file_hash(path), paths])[:16]
    dest = Path(datasets.config.HF_DATASETS_CACHE) / "finetune-encoded-copies"
    dest = dest / f"{key}-v{ENCODED_COPY_VERSION}-{Path(name).stem}.jsonl"
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as out:
        for row in damage.json_rows(path):
            for field_path in paths:
                row = _encode_at(row, field_path)
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, dest)
    return dest


def _encode_at(value: Any, path: list[Any]) -> Any:
    """``value`` with what is at ``path`` (0: each item of a list) written as its JSON text.

    >>> _encode_at({"a": "42", "b": 1}, ["a"]), _encode_at({"m": [{"c": "null"}, {"c": None}]}, ["m", 0, "c"])
    ({'a': '"42"', 'b': 1}, {'m': [{'c': '"null"'}, {'c': None}]})
    """
    if value is None:
        return None  # a missing value stays null, as datasets keeps it
    if not path:
        return json.dumps(value, ensure_ascii=False)
    key, *rest = path
    if key == 0:
        return [_encode_at(item, rest) for item in value] if isinstance(value, list) else value
    if not isinstance(value, dict) or key not in value:
        return value
    return {**value, key: _encode_at(value[key], rest)}


# ------------------------------------------------------------------------------------- damaged files


def _load_damaged(
    path_or_builder: str,
    entry: Any,
    label: str,
    on_bad_row: str | None,
    kwargs: dict[str, Any],
    error: Exception | None,
) -> datasets.Dataset:
    """A load failed (or read bytes that are not UTF-8): name the damage, or skip the damaged rows.

    Runs only after a failure: it reads every file of the split in Python (damage.scan).
    """
    resolved = _resolved_files(path_or_builder, entry, kwargs) if on_bad_row else None
    if resolved is None:
        raise DataError(_could_not_load(entry, label, error))
    builder, files = resolved
    try:
        scans = [damage.scan(f, builder, sep=kwargs.get("sep", ",")) for f in files]
    except DataError as e:
        raise DataError(f"{label}: {e}") from e
    bad = [b for found in scans for b in found.bad]
    if not bad:
        if len(files) > 1 and type(_innermost(error)).__name__ == "CastError":
            raise DataError(_columns_differ(files, builder, entry, label, kwargs)) from error
        raise DataError(_could_not_load(entry, label, error))
    if on_bad_row == "raise":
        raise DataError(f"{label}: {damage.describe(bad)}")
    if len(bad) == sum(found.num_rows for found in scans):
        raise DataError(
            f"{label}: every row is damaged, nothing to load: {damage.describe(bad, skip_hint=False)} "
            "Is this a data file of the format its extension says?"
        )
    warn(
        f"{label}: skipping {len(bad)} damaged row(s) (data.on_bad_row: skip; counted in the manifest): "
        f"{damage.describe(bad, skip_hint=False)}"
    )
    return _load_with_placeholders(scans, builder, entry, label, kwargs)


def _resolved_files(path_or_builder: str, entry: Any, kwargs: dict[str, Any]) -> tuple[str, list[str]] | None:
    """(builder name, the local files of the entry's split), as datasets resolves them; None when unknown."""
    data_files = kwargs.get("data_files")
    if isinstance(data_files, str) and not kwargs.get("data_dir"):
        return path_or_builder, [data_files]
    config = {k: kwargs[k] for k in ("data_dir", "data_files", "sep") if kwargs.get(k) is not None}
    try:
        builder = datasets.load_dataset_builder(path_or_builder, **config)
    except Exception:  # the original error says more than this one
        return None
    split = _base_split(entry.split)
    if any(_base_split(part) != split for part in entry.split.split("+")):
        return None  # a spec reading several splits: not worth the row bookkeeping
    files = next((list(v) for k, v in (builder.config.data_files or {}).items() if str(k) == split), None)
    return (builder.name, files) if files else None


def _load_with_placeholders(
    scans: list[damage.FileScan], builder: str, entry: Any, label: str, kwargs: dict[str, Any]
) -> datasets.Dataset:
    """Load clean copies of the damaged files (the others as they are), and mark the placeholder rows."""
    split = _base_split(entry.split)
    files = [str(_clean_copy(found)) if found.bad else found.path for found in scans]
    extra = {k: kwargs[k] for k in ("sep", "num_proc") if kwargs.get(k)}
    try:
        ds = datasets.load_dataset(builder, data_files={split: files}, split=split, **extra)
        if builder == "json":
            ds = _strings_kept(ds, files, entry, label, extra, split=split)
    except DataError:
        raise
    except Exception as e:
        raise DataError(
            f"{label}: {damage.describe([b for f in scans for b in f.bad], skip_hint=False)} Even with the "
            f"damaged rows replaced, the data could not be loaded: {_root_cause(e)}"
        ) from e
    marks: list[str | None] = [None] * len(ds)
    offset = 0
    for found in scans:
        for bad in found.bad:
            if offset + bad.row < len(marks):
                marks[offset + bad.row] = damage.mark(bad)
        offset += found.num_rows
    if offset != len(ds):  # the rows can't be matched to lines: skipping could drop the wrong ones
        raise DataError(
            f"{label}: {damage.describe([b for f in scans for b in f.bad], skip_hint=False)} Its rows could not "
            f"be matched to lines ({offset} counted, {len(ds)} loaded), so the damaged ones can't be skipped "
            "safely: fix the file."
        )
    fingerprint = Hasher.hash([ds._fingerprint, [(i, m) for i, m in enumerate(marks) if m]])
    ds = ds.add_column(damage.BAD_ROW_COLUMN, marks, new_fingerprint=fingerprint)
    return _select_split(ds, entry.split, split)


def _clean_copy(found: damage.FileScan) -> Path:
    """Where the clean copy of a damaged file goes: the datasets cache, named by the file's content.

    The same damaged file reuses its copy, so datasets also reuses the Arrow cache it built from it.
    """
    name = Path(found.path).name
    for ext in COMPRESSION_EXTENSIONS:
        name = name.removesuffix(ext)
    if found.array:
        name = f"{Path(name).stem}.jsonl"
    root = Path(datasets.config.HF_DATASETS_CACHE) / "finetune-clean-copies"
    return damage.write_clean_copy(
        found, root / f"{file_hash(found.path)}-v{damage.CLEAN_COPY_VERSION}-{name}"
    )


def _base_split(spec: str) -> str:
    """The split a split spec reads from.

    >>> _base_split("train[:10%]"), _base_split("validation")
    ('train', 'validation')
    """
    return spec.split("[", 1)[0].split("+", 1)[0].strip()


def _select_split(ds: datasets.Dataset, spec: str, split: str) -> datasets.Dataset:
    """Apply the slices of a split spec (``train[:100]``) to the whole split ``ds``."""
    parts = datasets.ReadInstruction.from_spec(spec).to_absolute({split: len(ds)})
    if len(parts) == 1 and (parts[0].from_, parts[0].to) == (0, len(ds)):
        return ds
    return ds.select(np.concatenate([np.arange(p.from_, p.to) for p in parts]))


def _columns_differ(files: list[str], builder: str, entry: Any, label: str, kwargs: dict[str, Any]) -> str:
    """The files of one entry load as one table, so they must have the same columns: say which differ."""
    extra = {k: kwargs[k] for k in ("sep",) if kwargs.get(k)}
    columns: dict[str, list[str]] = {}
    for f in files:
        try:  # each file alone (only on this error path)
            columns[f] = datasets.load_dataset(builder, data_files=f, split="train", **extra).column_names
        except Exception as e:
            columns[f] = [f"<unreadable: {_root_cause(e)}>"]
    common = Path(os.path.commonpath(files))  # called with two or more files
    groups: dict[tuple[str, ...], list[str]] = {}
    for f, cols in columns.items():
        groups.setdefault(tuple(cols), []).append(str(Path(f).relative_to(common)))
    listed = "; ".join(
        f"{', '.join(names[:3])}{f' (+{len(names) - 3} more)' if len(names) > 3 else ''}: {list(cols)}"
        for cols, names in groups.items()
    )
    return (
        f"{label}: the files of {entry.path!r} do not all have the same columns, and one entry's files load "
        f"as one table: {listed}. Give them the same columns, or make each kind of file its own entry in "
        "data.datasets (with data_files and its own field mappings)."
    )


def _innermost(error: BaseException | None) -> BaseException | None:
    while error is not None and (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    return error


def _could_not_load(entry: Any, label: str, error: Exception | None) -> str:
    return f"{label}: could not load {entry.path!r}: {_root_cause(error)}"


def _root_cause(error: BaseException | None) -> str:
    """The innermost error (datasets wraps the parser's error in a DatasetGenerationError)."""
    error = _innermost(error)
    if error is None:
        return "unknown error"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _from_disk(path: str, entry: Any, label: str) -> datasets.Dataset:
    try:
        loaded = datasets.load_from_disk(path)
    except FileNotFoundError as e:
        raise DataError(
            f"{label}: {path!r} is neither a data file (no known extension) nor a save_to_disk directory ({e}); "
            f"set {label}.ds_type for a data file"
        ) from e
    if isinstance(loaded, datasets.DatasetDict):
        if entry.split not in loaded:
            raise DataError(
                f"{label} ({path}): split {entry.split!r} does not exist; the saved dataset has "
                f"{list(loaded)}. Set {label}.split to one of them."
            )
        return loaded[entry.split]
    return loaded


# ------------------------------------------------------------------------------------------ streaming


def load_stream(entry: Any, *, entry_label: str = "data.datasets[0]") -> datasets.IterableDataset:
    """The rows of ``entry`` as a datasets IterableDataset (data.streaming): read as they are consumed,
    from the same places as `load_source` (local files and folders of them, save_to_disk folders, Hub
    ids, fsspec URLs). A folder of files or a saved dataset gives several shards (one per file or
    Arrow file), which is what lets each process read its own files (split_dataset_by_node)."""
    path, label, where = entry.path, entry_label, locate(entry)
    local = Path(path).expanduser()
    if where.kind == "missing":
        raise DataError(_missing(path, label))
    if where.kind == "hub":
        kwargs = {"name": entry.name, "data_files": entry.data_files, "revision": entry.revision}
        return _stream_dataset(path, entry, label, **kwargs)
    if where.kind == "url":
        check_filesystem(path, label)
    if where.kind == "local_dir":
        _check_has_data_files(local, entry, label)
    if where.kind == "saved_dataset" or (where.kind == "url" and where.builder is None):
        # a save_to_disk folder, local or on remote storage (a URL whose name is no data file)
        saved = _from_disk(str(local) if where.kind == "saved_dataset" else path, entry, label)
        return saved.to_iterable_dataset(num_shards=max(1, len(saved.cache_files)))
    if where.kind == "url":
        return _stream_dataset(where.builder, entry, label, data_files=_url_files(entry), **where.options)
    if where.kind == "local_dir":
        if where.builder:
            kwargs = {"data_dir": str(local), "data_files": entry.data_files, **where.options}
            return _stream_dataset(where.builder, entry, label, **kwargs)
        return _stream_dataset(str(local), entry, label)
    if where.builder is None:
        raise DataError(_unknown_format(local, label))
    return _stream_dataset(where.builder, entry, label, data_files=str(local), **where.options)


def _stream_dataset(path_or_builder: str, entry: Any, label: str, **kwargs: Any) -> datasets.IterableDataset:
    """``load_dataset(..., streaming=True)`` with its failures explained (nothing is read yet: damaged
    rows surface while the stream is read, finetune.data.batching.streaming)."""
    try:
        return datasets.load_dataset(path_or_builder, split=entry.split, streaming=True, **kwargs)
    except FileNotFoundError as e:
        raise DataError(
            f"{label}: file not found for {entry.path!r}: {e}. Check {label}.path and data_files."
        ) from e
    except ValueError as e:
        if "Unknown split" in str(e) or "Bad split" in str(e):
            raise DataError(
                f"{label} ({entry.path}): split {entry.split!r} does not exist: {e} Set {label}.split."
            ) from e
        raise DataError(f"{label}: cannot stream {entry.path!r}: {e}") from e
    except ConnectionError as e:
        raise DataError(
            f"{label}: {entry.path!r} is not a local path, and the Hugging Face Hub could not be reached to "
            f"stream it as a dataset id ({e}). Fix the path, or check the network and HF_ENDPOINT / HF_HUB_OFFLINE."
        ) from e
