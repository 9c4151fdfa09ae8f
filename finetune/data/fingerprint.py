"""What identifies a preparation of a recipe's LLM data, and what a cache hit needs, without
importing datasets or transformers.

The fingerprint (finetune.data.cache.compute_fingerprint of `fingerprint_inputs`) hashes everything
that changes the prepared output: the sources (file contents, Hub commits, URL metadata), the
tokenizer files (hashed as files: no tokenizer is loaded), the entries' settings and the data
section's. `cached` finds the complete preparation of a recipe from it, so that
`finetune prepare-dataset` on an already prepared recipe reads a few files and prints the summary:
the libraries that build a preparation (datasets, transformers, torch; finetune.data.prepare) are
imported only when there is something to build or load.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from finetune.data.cache import MANIFEST_NAME, compute_fingerprint
from finetune.errors import DataError

if TYPE_CHECKING:
    from finetune.recipe import Recipe

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
COMPRESSION_EXTENSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip")
SAVED_DATASET_FILES = ("state.json", "dataset_dict.json")
_HASH_CHUNK_BYTES = 1 << 20
# Image files a vision-language source may point at (hashed with it: finetune.data.images).
IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff"}
# Bump when the prepared layout or the meaning of its columns changes: old caches are then ignored.
# 2: chats with tool calls are trained (they were bad rows) and rendered with their row's tools.
# 3: message contents may be lists of parts (text; images for vision-language models): they were bad rows.
# 4: multipack's repair pass runs when greedy is within 10% of the bound (was 2%): packed rows differ.
#    One version for every preparation, so unpacked caches are rebuilt too (once).
FORMAT_VERSION = 4
# Files in a tokenizer folder that cannot change tokenization (model weights): not hashed.
_WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx"}
# Entry fields that do not change what is prepared.
_ENTRY_FIELDS_NOT_HASHED = {"trust_remote_code"}
# The hashed settings of an entry list, besides its own fields, every field the other formats read,
# at its default, as when one entry class held the fields of every type (format version 1): so a
# recipe keeps its fingerprint and its manifest now that each type has its own schema. Frozen:
# the fields of a new format are hashed only for entries of that type. A field the entry does not
# read cannot change its output, so its value here is a constant.
_FORMAT_1_FIELDS = {
    "field_text": "text",
    "field_instruction": "instruction",
    "field_input": "input",
    "field_output": "output",
    "field_prompt": "prompt",
    "field_completion": "completion",
    "field_chosen": "chosen",
    "field_rejected": "rejected",
    "field_label": "label",
    "field_messages": "messages",
    "message_field_role": "role",
    "message_field_content": "content",
    "role_map": {},
    "train_on_inputs": False,
    "roles_to_train": ["assistant"],
    "train_on_eos": "turn",
    "apply_chat_template": False,
}
# What one example of each kind is, for the summary.
_UNIT_NAMES = {"sft": "examples", "preference": "pairs", "kto": "examples", "prompt": "prompts"}


# ------------------------------------------------------------------------------------------ sources


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


def source_fingerprint(entry: Any) -> dict:
    """What identifies the content of ``entry``'s source (JSON-serializable).

    Local files: each file's relative name, size and blake2b hash. save_to_disk directories: the
    same for their arrow and json files. Hub ids: the commit sha the revision resolves to. URLs:
    the storage's metadata (etag, size, modification time).
    """
    path = entry.path
    if is_url(path):
        return {"kind": "url", "files": _url_info(entry)}
    local = Path(path).expanduser()
    if local.exists():
        if local.is_dir():
            files = local_dir_files(local, entry)
            kind = "saved_dataset" if any((local / n).exists() for n in SAVED_DATASET_FILES) else "local_dir"
            return {"kind": kind, "files": [_file_entry(f, f.relative_to(local).as_posix()) for f in files]}
        return {"kind": "local_file", "files": [_file_entry(local, local.name)]}
    if looks_local(path):
        raise DataError(f"{path!r} does not exist (resolved to {local.resolve()})")
    return {"kind": "hub", "repo": path, "revision": entry.revision, "sha": _hub_sha(path, entry.revision)}


def local_dir_files(root: Path, entry: Any) -> list[Path]:
    """The files of a local directory source that loading reads (and the fingerprint hashes)."""
    if any((root / n).exists() for n in SAVED_DATASET_FILES):
        files = [p for p in root.rglob("*") if p.is_file() and p.suffix in (".arrow", ".json")]
    elif entry.data_files:
        patterns = [entry.data_files] if isinstance(entry.data_files, str) else entry.data_files
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
    urls = (
        [url]
        if not files
        else [f"{url.rstrip('/')}/{f}" for f in ([files] if isinstance(files, str) else files)]
    )
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


# --------------------------------------------------------------------------------------- the recipe


def fingerprint_inputs(recipe: Recipe, *, with_files: bool = True) -> dict:
    """Everything the prepared output depends on, as plain JSON data (hashed by compute_fingerprint).

    `with_files=False` leaves out the parts that read the source and tokenizer files.

    Not included, because they do not change the output: dataset_num_proc,
    num_dataset_shards_to_save, push_dataset_to_hub, skip_prepare_dataset, dataloader_*,
    dataset_prepared_path, and each entry's trust_remote_code.
    """
    data, model = recipe.data, recipe.model
    packs = data.sample_packing or (data.eval_sample_packing and has_eval(data))
    settings = {
        "sequence_len": data.sequence_len,
        "excess_length_strategy": data.excess_length_strategy,
        "on_bad_row": data.on_bad_row,
        "sample_packing": data.sample_packing,
        "val_set_size": data.val_set_size,
        "shuffle_merged_datasets": data.shuffle_merged_datasets,
        "shuffle_before_merging_datasets": data.shuffle_before_merging_datasets,
    }
    if has_eval(data):
        settings["eval_sample_packing"] = data.eval_sample_packing
    vision = model.kind == "vlm"
    if vision:  # only then: the fingerprints of text recipes stay what they were
        settings["image_max_pixels"] = data.image_max_pixels
    if packs:
        settings |= {
            "sample_packing_method": data.sample_packing_method,
            "sample_packing_sequence_len": data.packing_len,
            "pad_to_multiple_of": data.pad_to_multiple_of,
        }
        if data.sample_packing_method == "multipack":
            settings["sample_packing_group_size"] = data.sample_packing_group_size
    return {
        "format_version": FORMAT_VERSION,
        "datasets": [_entry_inputs(e, with_files, vision) for e in data.datasets],
        "test_datasets": [_entry_inputs(e, with_files, vision) for e in data.test_datasets],
        "tokenizer": _tokenizer_inputs(model) if with_files else None,
        # None: the tokenizer's own template, which the tokenizer file hashes cover.
        "chat_template": model.resolved_chat_template,
        "special_tokens": model.special_tokens.model_dump(mode="json"),
        "data": settings,
        "seed": recipe.train.seed,
    }


def _entry_inputs(entry: Any, with_files: bool = True, vision: bool = False) -> dict:
    settings = _FORMAT_1_FIELDS | entry.model_dump(mode="json", exclude=_ENTRY_FIELDS_NOT_HASHED)
    if not vision:  # a text model reads no images: the field is left out, as before it existed
        settings.pop("field_images", None)
    if settings.get("field_margin", "") is None:
        # No margin column (preference pairs of every objective but reward): left out, as before the
        # field existed, so the fingerprints of preference recipes stay what they were.
        del settings["field_margin"]
    if settings.get("weight") == 1:
        # The default draws each row once, as before weights existed: left out, so the fingerprints
        # (and the caches) of recipes without weights stay what they were.
        del settings["weight"]
    out = {"settings": settings, "source": source_fingerprint(entry) if with_files else None}
    if vision and with_files:
        out["images"] = image_files(entry)
    return out


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


def has_eval(data: Any) -> bool:
    """Whether the data section makes an eval split (val_set_size or test_datasets)."""
    return bool(data.val_set_size) or bool(data.test_datasets)


def _tokenizer_inputs(model: Any) -> dict:
    """Content hashes of the tokenizer files (local folder) or the commit a Hub revision resolves to.

    A GGUF model's tokenizer is hashed in its converted folder (the files load_tokenizer reads).
    """
    from finetune.gguf.convert import resolve_model_source

    source = resolve_model_source(model).tokenizer_source
    local = Path(source).expanduser()
    if not local.exists() and looks_local(source):
        raise DataError(f"model.tokenizer_path: {source} does not exist (resolved to {local.resolve()})")
    if local.is_dir():
        files = {
            p.name: file_hash(p)
            for p in sorted(local.iterdir())
            if p.is_file() and not p.name.startswith(".") and p.suffix not in _WEIGHT_SUFFIXES
        }
        return {"kind": "local", "files": files}
    return {
        "kind": "hub",
        "repo": source,
        "revision": model.revision,
        "sha": _hub_tokenizer_sha(source, model.revision),
    }


def _hub_tokenizer_sha(repo: str, revision: str | None) -> str:
    from huggingface_hub import HfApi, try_to_load_from_cache

    try:
        return HfApi().model_info(repo, revision=revision).sha
    except Exception as exc:  # offline: the snapshot already in the cache names its commit
        for name in ("tokenizer_config.json", "tokenizer.json"):
            cached = try_to_load_from_cache(repo, name, revision=revision)
            if isinstance(cached, str) and "snapshots" in Path(cached).parts:
                parts = Path(cached).parts
                return parts[parts.index("snapshots") + 1]
        raise DataError(
            f"model.tokenizer_path: cannot resolve the Hub tokenizer {repo!r} (revision {revision or 'main'}) "
            f"to a commit: {type(exc).__name__}: {exc}. Use a local tokenizer folder or check the network."
        ) from exc


def cached(recipe: Recipe) -> tuple[Path, dict] | None:
    """(folder, manifest) of the complete preparation of `recipe` in data.dataset_prepared_path, or
    None when there is none (then finetune.data.prepare builds it, or pulls it from the Hub)."""
    path = Path(recipe.data.dataset_prepared_path) / compute_fingerprint(fingerprint_inputs(recipe))
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        return None
    return path, json.loads(manifest_path.read_text(encoding="utf-8"))


def reusing(path: Path) -> str:
    """The line said when a preparation is reused from the cache."""
    return f"reusing prepared dataset {path.name} at {path} (nothing to tokenize)"


def summary(manifest: dict, source: str, path: Path) -> str:
    """A few lines for the end of `finetune prepare-dataset`: rows, drops, tokens, packing, location;
    `source` says how it was got (built, cache, hub)."""
    m = manifest
    drops = ", ".join(f"{k}={v}" for k, v in m.get("dropped", {}).items()) or "none"
    lines = [
        f"prepared dataset {m['fingerprint']} ({source}) at {path}",
        f"  rows: {m['rows_in']} in, {m['rows_kept']} kept, {m['rows_dropped']} dropped ({drops}), "
        f"{m['truncated']} truncated",
    ]
    unit = _UNIT_NAMES[m.get("kind", "sft")]
    for name in ("train", "eval"):
        if name not in m["splits"]:
            continue
        s = m["splits"][name]
        lines.append(
            f"  {name}: {s['examples']} {unit} -> {s['rows']} rows of {s['row_capacity']} "
            f"({'packed, ' + s['packing_method'] if s['packed'] else 'unpacked'}); {s['num_tokens']:,} tokens, "
            f"{s['num_trainable_tokens']:,} trainable; packing efficiency {s['packing_efficiency']:.4f}"
        )
    return "\n".join(lines + mixture_lines(m.get("mixture", [])))


def mixture_lines(mixture: list[dict]) -> list[str]:
    """One summary line per training dataset when there are several or any is weighted: its weight,
    rows for training and drawn, and its shares of the training rows and trained tokens.

    >>> row = {"dataset": "data.datasets[0]", "path": "a.jsonl", "weight": 0.5, "rows_train": 9,
    ...        "rows_drawn": 5, "share_of_rows": 0.25, "share_of_trained_tokens": 0.3}
    >>> mixture_lines([row])
    ['  data.datasets[0] (a.jsonl): weight 0.5, 9 training rows -> 5 drawn; 25.0% of the rows, 30.0% of the trained tokens']
    """
    if len(mixture) < 2 and all(d["weight"] == 1 for d in mixture):
        return []

    def percent(share: float | None) -> str:
        return "n/a" if share is None else f"{share:.1%}"

    return [
        f"  {d['dataset']} ({Path(d['path']).name}): weight {d['weight']:g}, {d['rows_train']} training rows -> "
        f"{d['rows_drawn']} drawn; {percent(d['share_of_rows'])} of the rows, "
        f"{percent(d['share_of_trained_tokens'])} of the trained tokens"
        for d in mixture
    ]
