"""Prepare a recipe's datasets once: load, tokenize, mask, merge, split, pack, and cache.

`prepare(recipe)` is the one function that sees the whole recipe on the data side. Its output lives
in `data.dataset_prepared_path/<fingerprint>/` (`train/`, `eval/`, `manifest.json`); the
fingerprint hashes everything that changes the output (finetune.data.prepare.fingerprint), so the same
recipe and inputs reuse the folder without tokenizing anything, and any change that alters the
output gets a new folder.

The cache itself (fingerprints, atomic writes, the lock, stale folders) is finetune.data.prepare.cache,
shared with the image prepare step (finetune.diffusion.cache).

Preference data (entry types `preference` and `kto`, for train.objective dpo/ipo/simpo/orpo and
kto) goes through the same steps: a pair (kto: an example) is one tokenized example, the unit that
is counted, split, packed and never cut across rows; finetune.data.batching.pairs builds its rows. The
manifest's `kind` says which (`sft`, `preference`, `kto`).
"""

from __future__ import annotations

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
from finetune.data.batching.packing import (
    build_packed_rows,
    pack_multipack,
    pack_sequential,
    packing_efficiency,
)
from finetune.data.batching.pairs import PACKED_KINDS, pack_examples
from finetune.data.formats.registry import FORMATS
from finetune.data.formats.tokenize import tokenize_dataset
from finetune.data.prepare.cache import (
    MANIFEST_NAME,
    Prepared,
    cached_or_built,
    canonical_json,
    complete_dirs,
    compute_fingerprint,
    load_complete,
    write_atomically,
)
from finetune.data.prepare.fingerprint import fingerprint_inputs
from finetune.data.prepare.manifest import make_manifest, reusing, summary
from finetune.data.prepare.mixture import (
    EFFECTIVE_WEIGHT_WARN,
    draw_count,
    mix,
    per_example_tokens,
    shares,
    smallest_weight,
)
from finetune.data.sources.readers import load_source
from finetune.errors import DataError, RecipeError
from finetune.notices import warn
from finetune.recipe.schema import VLM_NO_PACKING

if TYPE_CHECKING:
    from finetune.recipe import Recipe

# Per-example columns of preference pairs and kto examples, kept through merge and split.
# Vision-language rows keep their image bytes (finetune.data.batching.vision) the same way, and pairs
# with a margin column (field_margin) their margins.
_EXTRA_COLUMNS = (*(name for fmt in FORMATS.values() for name in fmt.features), "images", "margin")
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
            log(reusing(prepared.path))
    if push or (prepared.source == "built" and data.push_dataset_to_hub):
        _push(recipe, prepared, log)
    log(summary(prepared.manifest, prepared.source, prepared.path))
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
    weight: float = 1.0  # data.datasets[].weight (finetune.data.prepare.mixture)


def _build(
    recipe: Recipe, inputs: dict, root: Path, fingerprint: str, log: Callable[[str], None]
) -> Prepared:
    """Tokenize, merge, split, pack and save; returns the saved dataset (memory-mapped)."""
    from finetune.model.build import load_tokenizer, pad_token_id
    from finetune.model.vlm import load_processor

    data = recipe.data
    t_start = time.perf_counter()
    timings: dict[str, float] = {"load": 0.0, "tokenize": 0.0}
    num_proc = data.dataset_num_proc or os.cpu_count() or 1
    _check_lengths(data)
    # A vision-language model's processor reads the images; its tokenizer is the one that tokenizes.
    processor = load_processor(recipe.model) if recipe.model.kind == "vlm" else None
    tokenizer = processor.tokenizer if processor is not None else load_tokenizer(recipe.model)
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
            processor=processor,
            image_max_pixels=data.image_max_pixels,
            allow_image_paths_outside=data.allow_image_paths_outside,
        )
        timings["load"] += t1 - t0
        timings["tokenize"] += time.perf_counter() - t1
        parts.append(_part(label, split, entry, result))

    t0 = time.perf_counter()
    train_parts = [p for p in parts if p.split == "train"]
    split = _merge_and_split(recipe, train_parts)
    _check_draws(train_parts, split, log)
    eval_parts = ([split.val] if split.val is not None else []) + [
        p.dataset for p in parts if p.split == "eval"
    ]
    eval_ds = datasets.concatenate_datasets(eval_parts) if eval_parts else None
    timings["merge_split"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    pad_id, kind = pad_token_id(tokenizer), data_kind(data)
    splits = {"train": _pack(split.train, data, packed=data.sample_packing, pad_id=pad_id, kind=kind)}
    mixture = _mixture(train_parts, split, splits["train"])
    if eval_ds is not None and len(eval_ds):
        splits["eval"] = _pack(eval_ds, data, packed=data.eval_sample_packing, pad_id=pad_id, kind=kind)
    timings["pack"] = time.perf_counter() - t0

    rows, stats = {}, {}
    for name, (ds, split_stats) in splits.items():
        rows[name], stats[name] = ds, split_stats
        _warn_kto_alone(name, split_stats, log)
    sources, samples = [p.stats for p in parts], [s for p in parts for s in p.bad_row_samples]
    manifest = make_manifest(fingerprint, inputs, sources, samples, stats, timings) | {
        "kind": kind,
        "mixture": mixture,
    }
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
    return _Part(label, split, ds, stats, list(result.bad_row_samples), entry.weight)


def _token_counts(ds: datasets.Dataset) -> tuple[int, int]:
    """(tokens, tokens with a label) over the rows of `ds`, computed on the Arrow columns."""
    if len(ds) == 0:
        return 0, 0
    table = ds.select_columns(["input_ids", "labels"]).with_format("arrow")[:]
    num_tokens = int(pc.sum(pc.list_value_length(table.column("input_ids"))).as_py() or 0)
    labels = pc.list_flatten(table.column("labels"))
    num_trainable = int(pc.sum(pc.not_equal(labels, IGNORE_INDEX)).as_py() or 0)
    return num_tokens, num_trainable


@dataclass
class _Split:
    """The training and validation rows of the merged training entries, and where they came from."""

    train: datasets.Dataset  # the weighted mixture
    val: datasets.Dataset | None
    train_sources: np.ndarray  # the entry index of every training row (after weighting)
    rows_eval: np.ndarray  # per entry: rows held out for validation
    rows_train: np.ndarray  # per entry: training rows before weighting


def _merge_and_split(recipe: Recipe, parts: list[_Part]) -> _Split:
    """Shuffle each (optional), concatenate, shuffle (optional), split off val_set_size with the seed,
    then draw the weighted mixture from the training side (finetune.data.prepare.mixture).

    The steps compose index arrays into the concatenated entries, applied by one `select` per split,
    so the mixture knows every row's entry without a column added to the data (add_column would copy
    it). A shuffle is the permutation datasets' `shuffle(seed=seed)` draws
    (np.random.default_rng(seed).permutation), so a recipe without weights prepares the rows it
    prepared before weights existed. The validation rows are held out before weighting: a row drawn
    twice is never in both splits.
    """
    data, seed = recipe.data, recipe.train.seed
    columns = ["input_ids", "labels"]
    columns += [c for c in _EXTRA_COLUMNS if parts and c in parts[0].dataset.column_names]
    merged = datasets.concatenate_datasets([p.dataset.select_columns(columns) for p in parts])
    sizes = np.array([len(p.dataset) for p in parts], dtype=np.int64)
    if len(merged) == 0:
        _raise_no_rows(parts)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    order = np.arange(len(merged), dtype=np.int64)
    if data.shuffle_before_merging_datasets:
        order = np.concatenate(
            [
                start + np.random.default_rng(seed).permutation(n)
                for start, n in zip(offsets[:-1], sizes, strict=True)
            ]
        ).astype(np.int64)
    if data.shuffle_merged_datasets:
        order = order[np.random.default_rng(seed).permutation(len(order))]
    train_idx, val_idx = _validation_split(order, data.val_set_size, seed)
    # The entry of a row index: the last entry starting at or before it (empty entries start where the
    # next one does).
    sources = np.searchsorted(offsets, train_idx, side="right") - 1
    positions = mix(
        train_idx - offsets[sources],
        sources,
        [p.weight for p in parts],
        seed=seed,
        shuffle=data.shuffle_merged_datasets,
    )
    rows_eval = np.zeros_like(sizes)
    if val_idx is not None:
        rows_eval = np.bincount(np.searchsorted(offsets, val_idx, side="right") - 1, minlength=len(parts))
    return _Split(
        train=merged.select(train_idx[positions]),
        val=merged.select(val_idx) if val_idx is not None else None,
        train_sources=sources[positions],
        rows_eval=rows_eval,
        rows_train=np.bincount(sources, minlength=len(parts)),
    )


def _raise_no_rows(parts: list[_Part]) -> None:
    dropped = {f"{p.label} ({p.stats['path']})": p.stats["dropped"] for p in parts}
    samples = [s for p in parts for s in p.bad_row_samples]
    first = (
        f"; first: {samples[0]['dataset']} row {samples[0]['row']}: {samples[0]['detail']}" if samples else ""
    )
    raise DataError(f"no training rows left after tokenization (dropped per dataset: {dropped}){first}")


def _validation_split(
    order: np.ndarray, size: int | float | None, seed: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """(training, validation) parts of `order`: `size` rows (or that fraction) picked by a seeded
    permutation, both sides keeping the order's order."""
    if not size:
        return order, None
    n = len(order)
    num_val = size if isinstance(size, int) else round(size * n)
    if not 0 < num_val < n:
        raise DataError(
            f"data.val_set_size: {size} gives {num_val} validation rows out of {n}; it must leave at least one "
            "row on each side (use an int for a number of rows or a fraction in (0, 1))"
        )
    perm = np.random.default_rng(seed).permutation(n)
    return order[np.sort(perm[num_val:])], order[np.sort(perm[:num_val])]


def _check_draws(parts: list[_Part], split: _Split, log: Callable[[str], None]) -> None:
    """A weight that draws nothing from a dataset with training rows is an error (the entry would
    not be trained at all: remove it instead); one that the dataset is too small to meet closely
    (rows drawn / rows far from the weight) is a warning."""
    for part, n in zip(parts, split.rows_train.tolist(), strict=True):
        drawn = draw_count(part.weight, n)
        where = f"{part.label}.weight ({part.weight:g}, {part.stats['path']})"
        if n and not drawn:
            raise DataError(
                f"{where} draws 0 of the dataset's {n} training rows, so none of it would be trained: raise the "
                f"weight to at least {smallest_weight(n):g} (half a row rounds up to one) or remove the entry"
            )
        if n and abs(drawn / n - part.weight) > EFFECTIVE_WEIGHT_WARN * part.weight:
            warn(
                f"{where} draws {drawn} of {n} training rows, an effective weight of {drawn / n:.3g}: the "
                "dataset is too small for that fraction; use a weight whose fraction of its rows is nearer a "
                "whole number of rows",
                emit=log,
            )


def _mixture(parts: list[_Part], split: _Split, packed: tuple[datasets.Dataset, dict]) -> list[dict]:
    """Per training entry: its weight, rows in / kept / held out for validation / for training /
    drawn, and its tokens and trained tokens in the prepared training rows with their shares.

    Packing keeps every example exactly once (finetune.data.batching.packing checks it), so the trained
    tokens of an entry are those of its examples; their sum is checked against the labels of the
    packed rows themselves.
    """
    rows, stats = packed
    table = split.train.select_columns(["input_ids", "labels"]).with_format("arrow")[:]
    labels = table.column("labels").combine_chunks()
    lengths = pc.list_value_length(labels).to_numpy(zero_copy_only=False).astype(np.int64)
    mask = pc.not_equal(pc.list_flatten(labels), IGNORE_INDEX).to_numpy(zero_copy_only=False)
    count = len(parts)
    drawn = np.bincount(split.train_sources, minlength=count)
    tokens = np.bincount(split.train_sources, weights=lengths, minlength=count).astype(np.int64)
    trained = np.bincount(
        split.train_sources, weights=per_example_tokens(lengths, mask), minlength=count
    ).astype(np.int64)
    in_rows = _token_counts(rows)[1] if "labels" in rows.column_names else 0
    if int(trained.sum()) != in_rows or int(trained.sum()) != stats["num_trainable_tokens"]:
        raise AssertionError(
            f"trained tokens per dataset {trained.tolist()} do not add up to the rows' {in_rows}"
        )
    out = []
    row_shares, token_shares = shares(drawn), shares(trained)
    for i, part in enumerate(parts):
        kept, n = part.stats["rows_kept"], int(split.rows_train[i])
        if kept != int(split.rows_eval[i]) + n or int(drawn[i]) != draw_count(part.weight, n):
            raise AssertionError(f"{part.label}: mixture accounting does not balance")
        out.append(
            {
                "dataset": part.label,
                "path": part.stats["path"],
                "weight": part.weight,
                "rows_in": part.stats["rows_in"],
                "rows_kept": kept,
                "rows_eval": int(split.rows_eval[i]),
                "rows_train": n,
                "rows_drawn": int(drawn[i]),
                "effective_weight": round(int(drawn[i]) / n, 6) if n else None,
                "num_tokens": int(tokens[i]),
                "num_trained_tokens": int(trained[i]),
                "share_of_rows": row_shares[i],
                "share_of_trained_tokens": token_shares[i],
            }
        )
    return out


def _pack(
    ds: datasets.Dataset, data: Any, *, packed: bool, pad_id: int, kind: str = "sft"
) -> tuple[datasets.Dataset, dict]:
    """Packed rows (or one example per row) and the split's statistics. A preference pair or kto
    example is one example here (finetune.data.batching.pairs builds their rows)."""
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
    if "images" in ds.column_names:  # unpacked (the recipe refuses packing images): rows in dataset order
        if bins is not None:
            raise DataError(f"rows with images cannot be packed: {VLM_NO_PACKING}")
        rows = datasets.concatenate_datasets([rows, ds.select_columns(["images"])], axis=1)
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
    # Unpacked kto rows (images) take their KL rows from the split instead (finetune.data.batching.vision).
    if kind == "kto" and packed:
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
