"""Prepare a recipe's datasets once: load, tokenize, mask, merge, split, pack, and cache.

`prepare(recipe)` is the one function that sees the whole recipe on the data side. Its output lives
in `data.dataset_prepared_path/<fingerprint>/` (`train/`, `eval/`, `manifest.json`); the
fingerprint hashes everything that changes the output (see `fingerprint_inputs`), so the same
recipe and inputs reuse the folder without tokenizing anything, and any change that alters the
output gets a new folder.

The cache itself (fingerprints, atomic writes, the lock, stale folders) is finetune.data.cache,
shared with the image prepare step (finetune.diffusion.cache).

Preference data (entry types `preference` and `kto`, for train.objective dpo/ipo/simpo/orpo and
kto) goes through the same steps: a pair (kto: an example) is one tokenized example, the unit that
is counted, split, packed and never cut across rows; finetune.data.preference builds its rows. The
manifest's `kind` says which (`sft`, `preference`, `kto`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np
import pyarrow.compute as pc

from finetune import hub
from finetune.constants import IGNORE_INDEX
from finetune.data.cache import (
    MANIFEST_NAME,
    Prepared,
    cached_or_built,
    canonical_json,
    complete_dirs,
    compute_fingerprint,
    library_versions,
    load_complete,
    write_atomically,
)
from finetune.data.formats import FORMATS
from finetune.data.packing import (
    build_packed_rows,
    pack_multipack,
    pack_sequential,
    packing_efficiency,
)
from finetune.data.preference import PACKED_KINDS, pack_examples
from finetune.data.sources import file_hash, load_source, looks_local, source_fingerprint
from finetune.data.tokenize import tokenize_dataset
from finetune.errors import DataError, RecipeError
from finetune.notices import warn

if TYPE_CHECKING:
    from finetune.recipe import Recipe

# Bump when the prepared layout or the meaning of its columns changes: old caches are then ignored.
FORMAT_VERSION = 1
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
# Per-example columns of preference pairs and kto examples, kept through merge and split.
_EXTRA_COLUMNS = tuple(name for fmt in FORMATS.values() for name in fmt.features)
# What one example of each kind is, for the summary.
_UNIT_NAMES = {"sft": "examples", "preference": "pairs", "kto": "examples", "prompt": "prompts"}
# Above this share of kto examples alone in their packed row (no mismatched completion for the KL
# estimate), prepare warns.
_KTO_ALONE_WARN = 0.05


def data_kind(data: Any) -> str:
    """`preference`, `kto`, `prompt` or `sft`: what the data section's entries prepare, from the `kind`
    of their schema classes (the recipe checks that they agree with train.objective).

    >>> from types import SimpleNamespace as NS
    >>> from finetune.recipe import dataset_entry
    >>> data_kind(NS(datasets=[dataset_entry(path="p.jsonl", type="preference")], test_datasets=[]))
    'preference'
    """
    kinds = {type(e).kind for e in [*data.datasets, *data.test_datasets]}
    return next((kind for kind in (*PACKED_KINDS, "prompt") if kind in kinds), "sft")


# ------------------------------------------------------------------------------------ entry points


def prepare(recipe: Recipe, *, push: bool = False, log: Callable[[str], None] = print) -> Prepared:
    """The prepared dataset of `recipe`: from the cache when present, else built (or pulled) and cached.

    `push=True` (or `data.push_dataset_to_hub` when this call builds it) pushes it to the Hub as
    config `<fingerprint>` of the `data.push_dataset_to_hub` dataset repo.
    """
    data = recipe.data
    if push and not data.push_dataset_to_hub:
        raise RecipeError("--push needs data.push_dataset_to_hub: the `org/name` dataset repo to push to")
    if data.skip_prepare_dataset:
        prepared = load_prepared(recipe)
        log(f"data.skip_prepare_dataset: using the prepared dataset at {prepared.path}")
    else:
        inputs = fingerprint_inputs(recipe)
        fingerprint = compute_fingerprint(inputs)
        root = Path(data.dataset_prepared_path)
        prepared = cached_or_built(
            root,
            fingerprint,
            build=lambda: _build(recipe, inputs, root, fingerprint, log),
            pull=(lambda: _pull(recipe, root, fingerprint, log)) if data.push_dataset_to_hub else None,
            log=log,
        )
        if prepared.source == "cache":
            log(f"reusing prepared dataset {fingerprint} at {prepared.path} (nothing to tokenize)")
    if push or (prepared.source == "built" and data.push_dataset_to_hub):
        _push(recipe, prepared, log)
    log(summary(prepared))
    return prepared


def load_prepared(recipe: Recipe) -> Prepared:
    """The prepared dataset of `recipe` from the cache only; DataError when it is missing.

    When the raw data or the tokenizer files are not available here (a training machine holding
    only the cache), the one cached preparation whose recipe-side inputs match is used.
    """
    root = Path(recipe.data.dataset_prepared_path)
    try:
        inputs = fingerprint_inputs(recipe)
    except DataError as exc:
        return _load_by_recipe_settings(recipe, root, reason=str(exc))
    fingerprint = compute_fingerprint(inputs)
    prepared = load_complete(root / fingerprint)
    if prepared is None:
        others = sorted(p.name for p in complete_dirs(root))
        hint = (
            f" The cache holds {len(others)} other preparation(s) ({', '.join(others[:5])}): the recipe, "
            "the data or the tokenizer changed since they were made."
            if others
            else ""
        )
        raise DataError(
            f"no prepared dataset for this recipe: {root / fingerprint} (fingerprint {fingerprint}) does not "
            f"exist or is incomplete.{hint} Create it with `finetune prepare-dataset <recipe.yaml>` (same "
            "recipe and overrides), or set data.skip_prepare_dataset: false to prepare it on the fly."
        )
    return prepared


def prepare_on_main_process(
    recipe: Recipe, accelerator: Any, *, push: bool = False, build: Callable[..., Prepared] | None = None
) -> Prepared:
    """`prepare` in a multi-process run: one process per machine builds, the others wait, then read
    the cache.

    The wait is a barrier on a gloo group of its own with a week-long timeout: the default process
    group's barrier would time out (10 to 30 minutes) on a long tokenization. If the building process
    fails, the launcher (torchrun) stops the waiting ones. One process per machine (not only the
    global main) builds, so nodes without a shared filesystem each get their cache; on a shared one
    the file lock lets the first build and the others find it done. Only the main process pushes.

    `build` is the prepare function, called as `build(recipe, push=..., log=...)`: `prepare`
    (tokenized text) by default, finetune.diffusion.cache.prepare_images for cached latents.
    """
    build = build or prepare
    if accelerator.num_processes == 1:
        return build(recipe, push=push, log=accelerator.print)
    group = patient_group()
    prepared = None
    if accelerator.is_local_main_process:
        prepared = build(recipe, push=push and accelerator.is_main_process, log=accelerator.print)
    torch_distributed().barrier(group=group)
    if prepared is None:
        prepared = build(recipe, log=lambda _: None)
    return prepared


def torch_distributed():
    import torch.distributed

    return torch.distributed


def patient_group(days: int = 7):
    """A gloo process group over all ranks whose collectives wait up to `days` (every rank must call it)."""
    from datetime import timedelta

    return torch_distributed().new_group(backend="gloo", timeout=timedelta(days=days))


# ------------------------------------------------------------------------------------- fingerprint


def fingerprint_inputs(recipe: Recipe, *, with_files: bool = True) -> dict:
    """Everything the prepared output depends on, as plain JSON data (hashed by compute_fingerprint).

    `with_files=False` leaves out the parts that read the source and tokenizer files.

    Not included, because they do not change the output: dataset_num_proc,
    num_dataset_shards_to_save, push_dataset_to_hub, skip_prepare_dataset, dataloader_*,
    dataset_prepared_path, and each entry's trust_remote_code.
    """
    data, model = recipe.data, recipe.model
    packs = data.sample_packing or (data.eval_sample_packing and _has_eval(data))
    settings = {
        "sequence_len": data.sequence_len,
        "excess_length_strategy": data.excess_length_strategy,
        "on_bad_row": data.on_bad_row,
        "sample_packing": data.sample_packing,
        "val_set_size": data.val_set_size,
        "shuffle_merged_datasets": data.shuffle_merged_datasets,
        "shuffle_before_merging_datasets": data.shuffle_before_merging_datasets,
    }
    if _has_eval(data):
        settings["eval_sample_packing"] = data.eval_sample_packing
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
        "datasets": [_entry_inputs(e, with_files) for e in data.datasets],
        "test_datasets": [_entry_inputs(e, with_files) for e in data.test_datasets],
        "tokenizer": _tokenizer_inputs(model) if with_files else None,
        # None: the tokenizer's own template, which the tokenizer file hashes cover.
        "chat_template": model.resolved_chat_template,
        "special_tokens": model.special_tokens.model_dump(mode="json"),
        "data": settings,
        "seed": recipe.train.seed,
    }


def _entry_inputs(entry: Any, with_files: bool = True) -> dict:
    settings = _FORMAT_1_FIELDS | entry.model_dump(mode="json", exclude=_ENTRY_FIELDS_NOT_HASHED)
    return {"settings": settings, "source": source_fingerprint(entry) if with_files else None}


def _has_eval(data: Any) -> bool:
    return bool(data.val_set_size) or bool(data.test_datasets)


def _tokenizer_inputs(model: Any) -> dict:
    """Content hashes of the tokenizer files (local folder) or the commit a Hub revision resolves to.

    A GGUF model's tokenizer is hashed in its converted folder (the files load_tokenizer reads).
    """
    from finetune.gguf import resolve_model_source

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


# ----------------------------------------------------------------------------------------- cache


def _load_by_recipe_settings(recipe: Recipe, root: Path, *, reason: str) -> Prepared:
    """Find the cached preparation made with this recipe's settings when the sources can't be hashed."""
    wanted = _without_files(fingerprint_inputs(recipe, with_files=False))
    matches = []
    for path in complete_dirs(root):
        inputs = json.loads((path / MANIFEST_NAME).read_text(encoding="utf-8")).get("fingerprint_inputs", {})
        if _without_files(inputs) == wanted:
            matches.append(path)
    if len(matches) == 1:
        return load_complete(matches[0])
    found = (
        f"{len(matches)} cached preparations match its settings"
        if matches
        else "no cached preparation matches"
    )
    raise DataError(
        f"data.skip_prepare_dataset: cannot fingerprint the recipe's inputs ({reason}) and {found} in {root}. "
        "Run `finetune prepare-dataset <recipe.yaml>` where the data and the tokenizer are available."
    )


def _without_files(inputs: dict) -> dict:
    """fingerprint_inputs minus what needs the source and tokenizer files."""
    out = {k: v for k, v in inputs.items() if k != "tokenizer"}
    for key in ("datasets", "test_datasets"):
        out[key] = [{"settings": e.get("settings")} for e in inputs.get(key, [])]
    return json.loads(canonical_json(out))


# ------------------------------------------------------------------------------------------ build


@dataclass
class _Part:
    """One tokenized dataset entry and its accounting."""

    label: str
    split: str  # "train" or "eval": where its rows go
    dataset: datasets.Dataset
    stats: dict = field(default_factory=dict)
    bad_row_samples: list = field(default_factory=list)


def _build(
    recipe: Recipe, inputs: dict, root: Path, fingerprint: str, log: Callable[[str], None]
) -> Prepared:
    """Tokenize, merge, split, pack and save; returns the saved dataset (memory-mapped)."""
    from finetune.model import load_tokenizer, pad_token_id

    data = recipe.data
    t_start = time.perf_counter()
    timings: dict[str, float] = {"load": 0.0, "tokenize": 0.0}
    num_proc = data.dataset_num_proc or os.cpu_count() or 1
    _check_lengths(data)
    tokenizer = load_tokenizer(recipe.model)
    timings["tokenizer"] = time.perf_counter() - t_start

    entries = [(e, f"data.datasets[{i}]", "train") for i, e in enumerate(data.datasets)]
    entries += [(e, f"data.test_datasets[{i}]", "eval") for i, e in enumerate(data.test_datasets)]
    parts = []
    for entry, label, split in entries:
        t0 = time.perf_counter()
        raw = load_source(entry, num_proc=num_proc, entry_label=label, on_bad_row=data.on_bad_row)
        t1 = time.perf_counter()
        log(f"{label}: {len(raw)} rows from {entry.path}; tokenizing")
        result = tokenize_dataset(
            raw,
            entry,
            tokenizer,
            sequence_len=data.sequence_len,
            excess_length_strategy=data.excess_length_strategy,
            on_bad_row=data.on_bad_row,
            chat_template=recipe.model.resolved_chat_template,
            num_proc=num_proc,
            entry_label=label,
        )
        timings["load"] += t1 - t0
        timings["tokenize"] += time.perf_counter() - t1
        parts.append(_part(label, split, entry, result))

    t0 = time.perf_counter()
    train, val = _merge_and_split(recipe, [p for p in parts if p.split == "train"])
    eval_parts = ([val] if val is not None else []) + [p.dataset for p in parts if p.split == "eval"]
    eval_ds = datasets.concatenate_datasets(eval_parts) if eval_parts else None
    timings["merge_split"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    pad_id, kind = pad_token_id(tokenizer), data_kind(data)
    splits = {"train": _pack(train, data, packed=data.sample_packing, pad_id=pad_id, kind=kind)}
    if eval_ds is not None and len(eval_ds):
        splits["eval"] = _pack(eval_ds, data, packed=data.eval_sample_packing, pad_id=pad_id, kind=kind)
    timings["pack"] = time.perf_counter() - t0

    rows, stats = {}, {}
    for name, (ds, split_stats) in splits.items():
        rows[name], stats[name] = ds, split_stats
        _warn_kto_alone(name, split_stats, log)
    manifest = _manifest(fingerprint, inputs, parts, stats, timings) | {"kind": kind}
    num_shards = data.num_dataset_shards_to_save
    write_atomically(
        root, fingerprint, rows, manifest, num_proc=num_proc, num_shards=num_shards, started=t_start
    )
    return load_complete(root / fingerprint, source="built")


def _check_lengths(data: Any) -> None:
    """An entry's max_seq_len must fit the row it is packed into (examples are never split)."""
    for key in ("datasets", "test_datasets"):
        packed = data.sample_packing if key == "datasets" else data.eval_sample_packing
        for i, entry in enumerate(getattr(data, key)):
            if packed and entry.max_seq_len and entry.max_seq_len > data.packing_len:
                raise DataError(
                    f"data.{key}[{i}].max_seq_len ({entry.max_seq_len}) is longer than a packed row "
                    f"({data.packing_len} tokens): raise data.sample_packing_sequence_len or lower max_seq_len"
                )


def _part(label: str, split: str, entry: Any, result: Any) -> _Part:
    ds = result.dataset
    num_tokens, num_trainable = _token_counts(ds)
    dropped = dict(result.dropped)
    stats = {
        "dataset": label,
        "path": entry.path,
        "type": entry.type,
        "split": split,
        "rows_in": result.rows_in,
        "rows_kept": len(ds),
        "dropped": dropped,
        "rows_dropped": sum(dropped.values()),
        "truncated": result.truncated,
        "num_tokens": num_tokens,
        "num_trainable_tokens": num_trainable,
    }
    if stats["rows_in"] != stats["rows_kept"] + stats["rows_dropped"]:
        raise AssertionError(f"{label}: row accounting does not balance: {stats}")
    return _Part(label, split, ds, stats, list(result.bad_row_samples))


def _token_counts(ds: datasets.Dataset) -> tuple[int, int]:
    """(tokens, tokens with a label) over the rows of `ds`, computed on the Arrow columns."""
    if len(ds) == 0:
        return 0, 0
    table = ds.select_columns(["input_ids", "labels"]).with_format("arrow")[:]
    num_tokens = int(pc.sum(pc.list_value_length(table.column("input_ids"))).as_py() or 0)
    labels = pc.list_flatten(table.column("labels"))
    num_trainable = int(pc.sum(pc.not_equal(labels, IGNORE_INDEX)).as_py() or 0)
    return num_tokens, num_trainable


def _merge_and_split(recipe: Recipe, parts: list[_Part]) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """Shuffle each (optional), concatenate, shuffle (optional), split off val_set_size with the seed."""
    data, seed = recipe.data, recipe.train.seed
    columns = ["input_ids", "labels"]
    columns += [c for c in _EXTRA_COLUMNS if parts and c in parts[0].dataset.column_names]
    pieces = [p.dataset.select_columns(columns) for p in parts]
    if data.shuffle_before_merging_datasets:
        pieces = [ds.shuffle(seed=seed) for ds in pieces]
    merged = datasets.concatenate_datasets(pieces)
    if data.shuffle_merged_datasets:
        merged = merged.shuffle(seed=seed)
    if len(merged) == 0:
        dropped = {f"{p.label} ({p.stats['path']})": p.stats["dropped"] for p in parts}
        samples = [s for p in parts for s in p.bad_row_samples]
        first = (
            f"; first: {samples[0]['dataset']} row {samples[0]['row']}: {samples[0]['detail']}"
            if samples
            else ""
        )
        raise DataError(f"no training rows left after tokenization (dropped per dataset: {dropped}){first}")
    if not data.val_set_size:
        return merged, None
    n = len(merged)
    size = data.val_set_size
    num_val = size if isinstance(size, int) else round(size * n)
    if not 0 < num_val < n:
        raise DataError(
            f"data.val_set_size: {size} gives {num_val} validation rows out of {n}; it must leave at least one "
            "row on each side (use an int for a number of rows or a fraction in (0, 1))"
        )
    # A seeded permutation picks the validation rows; both sides keep the merged order.
    perm = np.random.default_rng(seed).permutation(n)
    return merged.select(np.sort(perm[num_val:])), merged.select(np.sort(perm[:num_val]))


def _pack(
    ds: datasets.Dataset, data: Any, *, packed: bool, pad_id: int, kind: str = "sft"
) -> tuple[datasets.Dataset, dict]:
    """Packed rows (or one example per row) and the split's statistics. A preference pair or kto
    example is one example here (finetune.data.preference builds their rows)."""
    lengths = pc.list_value_length(
        ds.select_columns(["input_ids"]).with_format("arrow")[:].column("input_ids")
    )
    lengths = lengths.to_numpy().astype(np.int64)
    num_tokens, num_trainable = _token_counts(ds)
    bins = None
    packed = packed and kind != "prompt"  # prompts are one per row: online RL samples their completions
    if packed:
        capacity = data.packing_len
        if data.sample_packing_method == "multipack":
            bins = pack_multipack(lengths, capacity, group_size=data.sample_packing_group_size)
        else:
            bins = pack_sequential(lengths, capacity)
    else:
        capacity = data.sequence_len
    multiple = data.pad_to_multiple_of if packed else None
    if kind == "prompt":
        rows = ds.select_columns(["input_ids", "row"])
    elif kind in PACKED_KINDS:
        rows = pack_examples(ds, bins, kind, pad_to_multiple_of=multiple, pad_token_id=pad_id)
    else:
        rows = build_packed_rows(ds, bins, pad_to_multiple_of=multiple, pad_token_id=pad_id)
    num_padded = int(pc.sum(pc.list_value_length(rows.data.column("input_ids"))).as_py() or 0)
    stats = {
        "examples": len(ds),
        "rows": len(rows),
        "packed": packed,
        "packing_method": data.sample_packing_method if packed else None,
        "row_capacity": capacity,
        "num_tokens": num_tokens,
        "num_trainable_tokens": num_trainable,
        "num_padding_tokens": num_padded - num_tokens,
        "packing_efficiency": round(packing_efficiency(lengths, len(rows), capacity), 6),
    }
    if kind == "kto":
        stats["examples_alone_in_row"] = int(sum(n == 1 for n in rows["num_units"]))
    return rows, stats


def _warn_kto_alone(split: str, stats: dict, log: Callable[[str], None]) -> None:
    """Kto examples alone in their row get no mismatched completion for the KL estimate: say so."""
    alone = stats.get("examples_alone_in_row", 0)
    if alone > _KTO_ALONE_WARN * max(stats["examples"], 1):
        warn(
            f"{split}: {alone} of {stats['examples']} kto examples are alone in their packed row, so their KL "
            "estimate uses their own completion; raise data.sample_packing_sequence_len so rows hold several",
            emit=log,
        )


def _manifest(fingerprint: str, inputs: dict, parts: list[_Part], splits: dict, timings: dict) -> dict:
    sources = [p.stats for p in parts]
    dropped: dict[str, int] = {}
    for s in sources:
        for reason, count in s["dropped"].items():
            dropped[reason] = dropped.get(reason, 0) + count
    train = splits["train"]
    return {
        "fingerprint": fingerprint,
        "fingerprint_sha256": hashlib.sha256(canonical_json(inputs).encode()).hexdigest(),
        "format_version": FORMAT_VERSION,
        "fingerprint_inputs": inputs,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "rows_in": sum(s["rows_in"] for s in sources),
        "rows_kept": sum(s["rows_kept"] for s in sources),
        "rows_dropped": sum(dropped.values()),
        "dropped": dict(sorted(dropped.items())),
        "truncated": sum(s["truncated"] for s in sources),
        "rows_out": {name: s["rows"] for name, s in splits.items()},
        "num_tokens": train["num_tokens"],
        "num_trainable_tokens": train["num_trainable_tokens"],
        "packing_efficiency": train["packing_efficiency"],
        "splits": splits,
        "sources": sources,
        "bad_row_samples": [s for p in parts for s in p.bad_row_samples],
        "timings": {k: round(v, 4) for k, v in timings.items()},
        "versions": library_versions(),
    }


def summary(prepared: Prepared) -> str:
    """A few lines for the end of `finetune prepare-dataset`: rows, drops, tokens, packing, location."""
    m = prepared.manifest
    drops = ", ".join(f"{k}={v}" for k, v in m.get("dropped", {}).items()) or "none"
    lines = [
        f"prepared dataset {m['fingerprint']} ({prepared.source}) at {prepared.path}",
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
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------- hub


def _pull(recipe: Recipe, root: Path, fingerprint: str, log: Callable[[str], None]) -> Prepared | None:
    """Use the Hub copy of this fingerprint when data.push_dataset_to_hub has it; None otherwise."""
    repo_id = recipe.data.push_dataset_to_hub
    try:
        pulled = hub.pull_prepared_dataset(repo_id, fingerprint)
    except Exception as exc:  # the Hub is a cache here: failing to read it means building locally
        warn(
            f"could not read {repo_id} config {fingerprint} from the Hub ({exc}); preparing locally", emit=log
        )
        return None
    if pulled is None:
        return None
    dataset_dict, manifest = pulled
    log(f"found prepared dataset {fingerprint} on the Hub ({repo_id}); saving it to {root / fingerprint}")
    splits = {name: dataset_dict[name] for name in ("train", "eval") if name in dataset_dict}
    manifest = {**manifest, "pulled_from": repo_id, "timings": dict(manifest.get("timings", {}))}
    num_proc = recipe.data.dataset_num_proc or os.cpu_count() or 1
    write_atomically(
        root,
        fingerprint,
        splits,
        manifest,
        num_proc=num_proc,
        num_shards=recipe.data.num_dataset_shards_to_save,
    )
    return load_complete(root / fingerprint, source="hub")


def _push(recipe: Recipe, prepared: Prepared, log: Callable[[str], None]) -> None:
    repo_id = recipe.data.push_dataset_to_hub
    splits = {"train": prepared.train}
    if prepared.eval is not None:
        splits["eval"] = prepared.eval
    fingerprint = prepared.manifest["fingerprint"]
    log(f"pushing prepared dataset {fingerprint} to {repo_id} (config {fingerprint})")
    hub.push_prepared_dataset(
        datasets.DatasetDict(splits),
        repo_id,
        config_name=fingerprint,
        manifest=prepared.manifest,
        private=recipe.hub.private,
    )
