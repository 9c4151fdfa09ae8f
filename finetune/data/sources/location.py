"""Where a dataset entry's data lives, which files it reads with which builder, and what identifies
them: plain functions of paths, without torch, datasets or transformers (finding a preparation in
the cache needs nothing more: finetune.data.prepare.fingerprint).

An entry's ``path`` is, checked in this order (`locate`):

* ``url``: an fsspec URL (``s3://``, ``gs://``, ``https://``, ``file://``, ...);
* ``saved_dataset``: a local folder written by ``save_to_disk``;
* ``local_dir``: a local folder of data files;
* ``local_file``: a local data file;
* ``missing``: meant as a local path (see `looks_local`), but nothing is there;
* ``hub``: otherwise, a Hugging Face Hub dataset id.

The readers (finetune.data.sources.readers) read what `locate` found; the fingerprint hashes what
`source_fingerprint` says identifies it. A file type is one row of `EXTENSION_TO_BUILDER`: its
extension and the datasets builder that reads it (docs/CONTRIBUTING.md, "Add a data source").

>>> from types import SimpleNamespace as NS
>>> locate(NS(path="s3://bucket/train.jsonl", ds_type=None, data_files=None))
Location(kind='url', builder='json', options={})
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.errors import DataError

# File extension -> datasets builder (the ds_type values plus the common aliases).
EXTENSION_TO_BUILDER = {
    ".json": "json",
    ".jsonl": "json",
    ".ndjson": "json",
    ".csv": "csv",
    ".tsv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".txt": "text",
}
BUILDERS = tuple(dict.fromkeys(EXTENSION_TO_BUILDER.values()))
"""The datasets builders of data files, in the table's order: the choices of an entry's ds_type."""
COMPRESSION_EXTENSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip")
SAVED_DATASET_FILES = ("state.json", "dataset_dict.json")
_HASH_CHUNK_BYTES = 1 << 20
# Image files a vision-language source may point at (hashed with it: finetune.data.formats.images).
IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff"}


# ------------------------------------------------------------------------------------------- where


def is_url(path: str) -> bool:
    """True for fsspec URLs (``s3://bucket/x.jsonl``, ``https://...``, ``file:///...``).

    >>> is_url("s3://bucket/train.jsonl"), is_url("data/train.jsonl"), is_url("org/name")
    (True, False, False)
    """
    return "://" in path


def looks_local(path: str) -> bool:
    """True when a path that doesn't exist was meant as a local path, not a Hub id.

    >>> looks_local("./data.jsonl"), looks_local("data/train.jsonl"), looks_local("openai/gsm8k")
    (True, True, False)
    """
    # Hub ids are "name" or "org/name"; anything else with a slash or a data extension is a path.
    return path.startswith(("/", ".", "~")) or path.count("/") > 1 or builder_for(path) is not None


def builder_for(path: str) -> str | None:
    """The ``datasets`` builder for a file name, from its extension (compression suffixes skipped).

    >>> builder_for("a/train.jsonl.gz"), builder_for("x.parquet"), builder_for("org/name")
    ('json', 'parquet', None)
    """
    return EXTENSION_TO_BUILDER.get(extension(path))


def extension(path: str) -> str:
    """A file name's data extension, compression suffixes skipped (``a.jsonl.gz`` -> ``.jsonl``)."""
    name = path.rstrip("/").rsplit("/", 1)[-1].lower()
    for ext in COMPRESSION_EXTENSIONS:
        name = name.removesuffix(ext)
    return os.path.splitext(name)[1]


def file_list(data_files: str | list[str] | None) -> list[str]:
    """An entry's data_files as a list (a single name is a list of one)."""
    return [data_files] if isinstance(data_files, str) else list(data_files or [])


def builder_of_files(data_files: str | list[str] | None) -> str | None:
    """The builder of data files when their extensions all name the same one, else None.

    >>> builder_of_files(["a.jsonl", "b.json.gz"]), builder_of_files(["a.jsonl", "b.csv"])
    ('json', None)
    """
    builders = {builder_for(f) for f in file_list(data_files)}
    return builders.pop() if len(builders) == 1 else None


def builder_kwargs(builder: str | None, data_files: str | list[str] | None) -> dict[str, Any]:
    """Extra builder arguments the file names imply (tab-separated .tsv files).

    >>> builder_kwargs("csv", ["a.tsv"]), builder_kwargs("csv", "a.csv")
    ({'sep': '\\t'}, {})
    """
    files = file_list(data_files)
    if builder == "csv" and files and all(extension(f) == ".tsv" for f in files):
        return {"sep": "\t"}
    return {}


def is_saved_dataset(folder: Path) -> bool:
    """Whether a local folder was written by ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return any((folder / name).exists() for name in SAVED_DATASET_FILES)


@dataclass(frozen=True)
class Location:
    """Where an entry's path points (`kind`, see the module docstring), the datasets builder that reads
    its files (the entry's ds_type, else the one its file names give; None: datasets decides for a
    folder, a URL without one is a save_to_disk folder, a local file without one is an error), and the
    builder's options its file names imply (`builder_kwargs`)."""

    kind: str
    builder: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


def locate(entry: Any) -> Location:
    """Where `entry.path` points and which builder reads it (its `ds_type` and `data_files` count)."""
    path = entry.path
    if is_url(path):
        files = file_list(entry.data_files)
        builder = entry.ds_type or (builder_of_files(files) if files else builder_for(path))
        return Location("url", builder, builder_kwargs(builder, files or path))
    local = Path(path).expanduser()
    if local.is_dir():
        if is_saved_dataset(local):
            return Location("saved_dataset")
        builder = entry.ds_type or builder_of_files(entry.data_files)
        return Location("local_dir", builder, builder_kwargs(builder, entry.data_files))
    if local.exists():
        builder = entry.ds_type or builder_for(str(local))
        return Location("local_file", builder, builder_kwargs(builder, str(local)))
    return Location("missing" if looks_local(path) else "hub")


def local_dir_files(root: Path, entry: Any) -> list[Path]:
    """The files of a local directory source that loading reads (and the fingerprint hashes)."""
    if is_saved_dataset(root):
        files = [p for p in root.rglob("*") if p.is_file() and p.suffix in (".arrow", ".json")]
    elif entry.data_files:
        patterns = file_list(entry.data_files)
        files = [p for pattern in patterns for p in root.glob(pattern) if p.is_file()]
        if not files:
            raise DataError(f"no file in {root} matches data_files {patterns}")
    else:  # what load_dataset would read: data files (any file when ds_type names the format)
        files = [
            p
            for p in root.rglob("*")
            if p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(root).parts)
            and (entry.ds_type or builder_for(p.name))
        ]
    return sorted(set(files))


# ------------------------------------------------------------------------------------ what it holds


def source_fingerprint(entry: Any) -> dict:
    """What identifies the content of ``entry``'s source (JSON-serializable).

    Local files: each file's relative name, size and blake2b hash. save_to_disk directories: the
    same for their arrow and json files. Hub ids: the commit sha the revision resolves to. URLs:
    the storage's metadata (etag, size, modification time).
    """
    path, kind = entry.path, locate(entry).kind
    local = Path(path).expanduser()
    if kind == "url":
        return {"kind": "url", "files": _url_info(entry)}
    if kind in ("saved_dataset", "local_dir"):
        files = local_dir_files(local, entry)
        return {"kind": kind, "files": [_file_entry(f, f.relative_to(local).as_posix()) for f in files]}
    if kind == "local_file":
        return {"kind": "local_file", "files": [_file_entry(local, local.name)]}
    if kind == "missing":
        raise DataError(f"{path!r} does not exist (resolved to {local.resolve()})")
    return {"kind": "hub", "repo": path, "revision": entry.revision, "sha": _hub_sha(path, entry.revision)}


def image_files(entry: Any) -> list[dict]:
    """Name, size and hash of every image file under a local source's folder (where the rows' relative
    image paths point; images stored as bytes are in the source's own hash)."""
    local = Path(entry.path).expanduser()
    if is_url(entry.path) or not local.exists():
        return []
    root = local if local.is_dir() else local.parent
    files = sorted(
        p
        for p in root.rglob("*")
        if p.is_file()
        and p.suffix.lower() in IMAGE_EXTENSIONS
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )
    return [_file_entry(p, p.relative_to(root).as_posix()) for p in files]


SHARD_BLOCK_BYTES = 1 << 16  # the first block of a shard, hashed into each stream checkpoint


def shard_identities(entry: Any) -> list[dict]:
    """What a streaming checkpoint records of each local file the stream of ``entry`` reads: its name,
    size, modification time (ns) and the blake2b of its first `SHARD_BLOCK_BYTES`; a resume compares
    them (finetune.data.batching.streaming). Hashing one block, not the file, keeps a checkpoint cheap
    over many large shards. Hub ids and URLs: none (their files are not on this machine).
    """
    kind = locate(entry).kind
    local = Path(entry.path).expanduser()
    if kind in ("saved_dataset", "local_dir"):
        files = [(f, f.relative_to(local).as_posix()) for f in local_dir_files(local, entry)]
    elif kind == "local_file":
        files = [(local, local.name)]
    else:
        return []
    out = []
    for path, name in files:
        info = path.stat()
        with open(path, "rb") as f:
            head = hashlib.blake2b(f.read(SHARD_BLOCK_BYTES), digest_size=16).hexdigest()
        out.append({"name": name, "size": info.st_size, "mtime_ns": info.st_mtime_ns, "head_blake2b": head})
    return out


def _file_entry(path: Path, name: str) -> dict:
    return {"name": name, "size": path.stat().st_size, "blake2b": file_hash(path)}


def file_hash(path: str | os.PathLike) -> str:
    """blake2b (128-bit) of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _hub_sha(repo: str, revision: str | None) -> str:
    from huggingface_hub import HfApi

    try:
        return HfApi().dataset_info(repo, revision=revision).sha
    except Exception as e:
        raise DataError(
            f"could not resolve Hub dataset {repo!r} (revision {revision or 'main'}): the Hub is unreachable or the "
            f"dataset doesn't exist ({type(e).__name__}: {e}). Use a local path for the data, or set "
            "data.skip_prepare_dataset: true to train from an already prepared cache."
        ) from e


_URL_INFO_KEYS = (
    "size",
    "etag",
    "ETag",
    "mtime",
    "LastModified",
    "last_modified",
    "md5Hash",
    "crc32c",
    "generation",
)


def _url_info(entry: Any) -> list[dict]:
    import fsspec

    url = entry.path
    files = entry.data_files
    urls = [url] if not files else [f"{url.rstrip('/')}/{f}" for f in file_list(files)]
    out = []
    try:
        for u in urls:
            fs, p = fsspec.core.url_to_fs(u)
            infos = [fs.info(p)]
            if infos[0].get("type") == "directory":
                infos = [fs.info(f) for f in sorted(fs.find(p))]
            for info in infos:
                out.append(
                    {"name": str(info.get("name", p))}
                    | {k: str(info[k]) for k in _URL_INFO_KEYS if k in info}
                )
    except Exception as e:
        raise DataError(f"could not read the metadata of {url!r}: {type(e).__name__}: {e}") from e
    return out
