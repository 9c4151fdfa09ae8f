"""Tokenize an entry's rows into ``input_ids`` and ``labels`` (-100 where nothing is trained).

The format of the entry's type (finetune/data/formats/<type>.py, found through `FORMATS`) turns a
batch of raw rows into token ids and labels, or a ``BadRow`` per row it can't use; this module
runs it over the dataset and applies what every format shares. Conventions (the packing and the
loss rely on them):

* ``labels`` are aligned with ``input_ids`` (the Hugging Face convention: the loss shifts), and
  ``labels[0]`` is always -100 because the first token is never predicted (of each sequence of an
  example: a preference pair holds two). Counting the tokens with a label therefore gives exactly
  the number of loss terms, in a packed row too.
* The length limit is ``entry.max_seq_len`` or ``sequence_len``; longer examples are dropped,
  truncated or raise (``excess_length_strategy``). A preference pair (chosen + rejected) is one
  example, the unit that is packed and never split; ``truncate`` shortens its longer sequence(s)
  from their end (`fit_lengths`). Every sequence must keep a trained token.
* Rows loaded as placeholders for damaged lines (marked in ``damage.BAD_ROW_COLUMN``, see
  finetune.data.sources.readers) become bad rows here, so they are raised or counted like any other.

Every input row is accounted for: ``rows_in == len(dataset) + sum(dropped.values())``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow.compute as pc
from datasets.fingerprint import Hasher

from finetune.constants import IGNORE_INDEX
from finetune.data.formats import images, registry
from finetune.data.formats.chat import check_roles_to_train
from finetune.data.formats.encode import Encoder, make_encoder
from finetune.data.formats.registry import Format, format_of
from finetune.data.formats.rows import TEMPLATE_WITHOUT_TOOLS, BadRow, Example
from finetune.data.sources import damage
from finetune.errors import DataError
from finetune.model import families

BATCH_SIZE = 1000
# Below this many rows, formats other than chat run in one process: the Rust tokenizer already
# spreads a batch over every core, and starting workers (each gets a pickled copy of the
# tokenizer) costs more than the Python work they would share. Chat rendering is Python-bound.
MIN_ROWS_FOR_PROCESSES = 100_000
MAX_BAD_ROW_SAMPLES = 10  # per reason

# Drop reasons besides "bad_row:<reason>" (finetune.data.formats.rows).
TOO_LONG = "too_long"
TOO_LONG_IMAGE_ROW = "too_long_image_row"  # too long, and not truncated because it has images
NO_TRAINABLE_TOKENS = "no_trainable_tokens"

_INTERNAL = ["_drop", "_field", "_detail", "_num_tokens", "_truncated"]
_FEATURES = datasets.Features(
    {
        "input_ids": datasets.List(datasets.Value("int32")),
        "labels": datasets.List(datasets.Value("int32")),
        "source_row": datasets.Value("int64"),
        "_drop": datasets.Value("string"),
        "_field": datasets.Value("string"),
        "_detail": datasets.Value("string"),
        "_num_tokens": datasets.Value("int64"),
        "_truncated": datasets.Value("bool"),
    }
)
# Bad rows raised whatever data.on_bad_row says: every such row would lose something (its tools, its images).
ALWAYS_RAISED = (TEMPLATE_WITHOUT_TOOLS, images.IMAGES_NEED_VLM)


def _features(fmt: Format, *, images: bool = False, margin: bool = False) -> datasets.Features:
    extra = {"images": datasets.List(datasets.Value("binary"))} if images else {}
    if margin:  # a preference entry's field_margin (train.objective reward): one number per pair
        extra["margin"] = datasets.Value("float32")
    return datasets.Features({**_FEATURES, **fmt.features, **extra})


@dataclass
class TokenizeResult:
    """The tokenized rows of one dataset entry and what happened to the others."""

    # input_ids, labels (list[int]), source_row (row index in the source); preference: chosen_len
    # (and margin, with field_margin); kto: desirable, prompt_len
    dataset: datasets.Dataset
    rows_in: int
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> rows
    truncated: int = 0
    # The first MAX_BAD_ROW_SAMPLES rows of each reason that has a detail (bad rows, empty completions).
    bad_row_samples: list[dict] = field(default_factory=list)


def tokenize_dataset(
    ds: datasets.Dataset,
    entry: Any,
    tokenizer: Any,
    *,
    sequence_len: int,
    excess_length_strategy: str,
    on_bad_row: str,
    chat_template: str | None = None,
    num_proc: int | None = None,
    entry_label: str = "data.datasets[0]",
    processor: Any = None,
    image_max_pixels: int | None = None,
    allow_image_paths_outside: bool = False,
) -> TokenizeResult:
    """Tokenize and label every row of ``ds`` as ``entry.type`` says; apply the length policy.

    The limit is ``entry.max_seq_len`` when set, else ``sequence_len``. Longer rows are dropped
    ("too_long"), truncated, or raise, per ``excess_length_strategy`` (drop|truncate|raise).
    Malformed rows raise a DataError naming the row, or with ``on_bad_row="skip"`` are dropped and
    counted ("bad_row:<reason>"). Rows left with no trained token are dropped
    ("no_trainable_tokens").

    With a vision-language `processor`, chat rows may hold images (finetune.data.batching.vision): they get an
    ``images`` column (the bytes, resized to `image_max_pixels`), and a row with images that is too long
    is dropped ("too_long_image_row") or raises, never truncated (that would cut its image tokens).
    """
    if excess_length_strategy not in ("drop", "truncate", "raise"):
        raise ValueError(
            f"excess_length_strategy must be drop, truncate or raise, not {excess_length_strategy!r}"
        )
    if on_bad_row not in ("raise", "skip"):
        raise ValueError(f"on_bad_row must be raise or skip, not {on_bad_row!r}")
    fmt = format_of(entry)
    registry.check_columns(entry, ds.column_names, features=ds.features, entry_label=entry_label)
    limit = entry.max_seq_len or sequence_len
    margin = getattr(entry, "field_margin", None) is not None
    features = _features(fmt, images=processor is not None, margin=margin)
    if len(ds) == 0:  # datasets skips the function on an empty dataset: no columns would exist
        public = datasets.Features({k: v for k, v in features.items() if k not in _INTERNAL})
        return TokenizeResult(datasets.Dataset.from_dict({k: [] for k in public}, features=public), rows_in=0)
    renders_chat = fmt.renders_chat(entry, ds.features)
    enc = _encoder(entry, fmt, tokenizer, chat_template, entry_label, chat=renders_chat, processor=processor)
    if processor is not None:
        enc = dataclasses.replace(
            enc,
            image_root=images.base_dir(entry.path),
            image_max_pixels=image_max_pixels,
            image_paths_outside=allow_image_paths_outside,
        )
    fn = _batch_function(fmt, entry, enc, features, limit, excess_length_strategy)
    out = ds.map(
        fn,
        batched=True,
        batch_size=BATCH_SIZE,
        with_indices=True,
        remove_columns=ds.column_names,
        features=features,
        num_proc=_worth_processes(renders_chat, len(ds), num_proc),
        new_fingerprint=_map_fingerprint(ds, entry, tokenizer, enc, limit, excess_length_strategy),
        desc=f"Tokenizing {entry_label}",
    )
    return _account(
        out, entry, entry_label, limit=limit, strategy=excess_length_strategy, on_bad_row=on_bad_row
    )


# ------------------------------------------------------------------------------------------ settings


def _worth_processes(renders_chat: bool, num_rows: int, num_proc: int | None) -> int | None:
    """``num_proc`` for the map, or None (one process) where workers would only add overhead."""
    if not num_proc or num_proc < 2 or num_rows <= BATCH_SIZE:
        return None
    if not renders_chat and num_rows < MIN_ROWS_FOR_PROCESSES:
        return None
    return min(num_proc, -(-num_rows // BATCH_SIZE))


def _map_fingerprint(
    ds: datasets.Dataset, entry: Any, tokenizer: Any, enc: Encoder, limit: int, strategy: str
) -> str:
    """The datasets-cache fingerprint of the map, from what its output depends on.

    Passed explicitly because datasets would otherwise hash the map function by pickling the
    tokenizer (about as slow as tokenizing GSM8K). The source of the modules that make the rows
    (this one, the formats and the paths they share) is included so that a code change never
    reuses a stale cache.
    """
    if getattr(tokenizer, "is_fast", False):
        vocab: Any = tokenizer.backend_tokenizer.to_str()
    else:
        vocab = sorted(tokenizer.get_vocab().items())
    dump = entry.model_dump(mode="json") if hasattr(entry, "model_dump") else dict(vars(entry))
    # This wing's modules (the formats, the paths they share and this one) and the families table
    # (which processor attributes name image markup, never trained).
    files = [*sorted(Path(__file__).parent.glob("*.py")), Path(families.__file__)]
    code = [p.read_bytes() for p in files]
    state = [type(tokenizer).__name__, vocab, tokenizer.special_tokens_map, tokenizer.chat_template]
    settings = [enc.prefix_ids, enc.eos_id, enc.chat_template, enc.vocab_size]
    if enc.processor is not None:  # the image processor's settings and the resize policy change the rows
        state.append(enc.processor.to_json_string())
        settings += [str(enc.image_root), enc.image_max_pixels]
        if enc.image_paths_outside:  # only then: the cache keys of confined data stay what they were
            settings.append("image_paths_outside")
    return Hasher.hash([ds._fingerprint, dump, state, settings, limit, strategy, code])


def _encoder(
    entry: Any,
    fmt: Format,
    tokenizer: Any,
    chat_template: str | None,
    entry_label: str,
    *,
    chat: bool,
    processor: Any = None,
) -> Encoder:
    """The entry's Encoder, after checking that the tokenizer can do what the format asks of it."""
    if chat:
        _check_chat(entry, tokenizer, chat_template, entry_label, trained=fmt.trained)
    if not chat and fmt.appends_eos and tokenizer.eos_token_id is None:
        raise DataError(
            f"{entry_label}: the tokenizer has no eos token, which type {entry.type!r} appends to every "
            "row; set model.special_tokens.eos_token"
        )
    return make_encoder(tokenizer, chat_template if chat else None, processor)


def _check_chat(
    entry: Any, tokenizer: Any, chat_template: str | None, entry_label: str, *, trained: bool = True
) -> None:
    """Check the tokenizer and the roles to train of a chat-rendered entry."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            f"{entry_label}: chat masking needs a fast (Rust) tokenizer for its offset mapping; "
            f"{type(tokenizer).__name__} is not one. Save the tokenizer with a tokenizer.json."
        )
    if not (chat_template or tokenizer.chat_template):
        what = (
            "apply_chat_template"
            if getattr(entry, "apply_chat_template", False)
            else f"type {entry.type} with messages"
        )
        raise DataError(
            f"{entry_label}: {what} needs a chat template, but the tokenizer has none; "
            "set model.chat_template (a Jinja string or a known name such as chatml or llama2)"
        )
    # alpaca and input_output turns are a user's and an assistant's: they have no role_map; prompts
    # (online RL) train no turn at all.
    if trained:
        check_roles_to_train(entry.roles_to_train, getattr(entry, "role_map", {}), entry_label)


# ------------------------------------------------------------------------------------- batch function


def _batch_function(
    fmt: Format, entry: Any, enc: Encoder, features: datasets.Features, limit: int, strategy: str
) -> Callable[..., dict[str, list]]:
    """The batch function both `tokenize_dataset` and `tokenize_stream` map over their rows: one
    place binds it, so a streamed row is tokenized exactly as a prepared one."""
    return functools.partial(
        _tokenize_batch, fmt=fmt, entry=entry, enc=enc, features=features, limit=limit, strategy=strategy
    )


def _tokenize_batch(
    batch: dict[str, list],
    indices: list[int],
    *,
    fmt: Format,
    entry: Any,
    enc: Encoder,
    features: datasets.Features,
    limit: int,
    strategy: str,
) -> dict[str, list]:
    """The ``ds.map`` function: a batch of raw rows -> ids, labels and a drop reason per row.

    Rows are never removed inside the map (one select after it keeps the rest), so that
    every row's fate is recorded in the ``_drop`` column and counted.
    """
    examples = fmt.tokenize(batch, entry, enc)
    if damage.BAD_ROW_COLUMN in batch:  # placeholders for damaged lines (see sources/readers.py)
        examples = [
            _damaged(mark) if mark else row
            for row, mark in zip(examples, batch[damage.BAD_ROW_COLUMN], strict=True)
        ]
    out: dict[str, list] = {name: [] for name in features}
    extra_names = [name for name in features if name not in _FEATURES]
    for row, index in zip(examples, indices, strict=True):
        values = _finish(row, extra_names, features, limit, strategy, trained=fmt.trained) | {
            "source_row": index
        }
        for name, value in values.items():
            out[name].append(value)
    return out


def _finish(
    row: Example | BadRow,
    extra_names: list[str],
    features: datasets.Features,
    limit: int,
    strategy: str,
    *,
    trained: bool = True,
) -> dict[str, Any]:
    """One row's columns: labels[0] = -100 (of each sequence), the length policy, the
    no-trainable-token check (formats whose rows are `trained`); a bad row's reason."""
    extra = {name: _empty(features[name]) for name in extra_names}
    if isinstance(row, BadRow):
        return _columns([], [], extra, drop=row.drop_key, field=row.field, detail=row.detail)
    ids, labels, *rest = row
    extra.update(rest[0] if rest else {})
    num_tokens = len(ids)
    # A preference pair is two sequences, chosen then rejected.
    lengths = (
        [extra["chosen_len"], num_tokens - extra["chosen_len"]] if "chosen_len" in extra else [num_tokens]
    )
    drop, truncated = "", False
    if num_tokens > limit:
        if extra.get("images") and strategy != "raise":
            drop = TOO_LONG_IMAGE_ROW  # cutting would cut image tokens: the model needs all of an image's
        elif strategy == "truncate":
            kept = fit_lengths(lengths, limit)
            ids = cut_sequences(ids, lengths, kept)
            labels = cut_sequences(labels, lengths, kept)
            lengths, truncated = kept, True
        else:
            drop = TOO_LONG
    starts = np.cumsum([0, *lengths[:-1]]).tolist()
    for start in starts if labels else ():
        labels[start] = IGNORE_INDEX  # the first token of a sequence is never predicted
    if (
        trained
        and not drop
        and not all(
            any(x != IGNORE_INDEX for x in labels[a : a + n]) for a, n in zip(starts, lengths, strict=True)
        )
    ):
        drop = NO_TRAINABLE_TOKENS
    if "chosen_len" in extra:
        extra["chosen_len"] = lengths[0]
    if drop:
        ids, labels = [], []
    return _columns(ids, labels, extra, drop=drop, num_tokens=num_tokens, truncated=truncated)


def fit_lengths(lengths: Sequence[int], limit: int) -> list[int]:
    """Sequence lengths cut so that they sum to at most `limit`: a sequence no longer than an equal
    share of what is left keeps its length, the longer ones share the rest equally (the policy of
    `excess_length_strategy: truncate` for a pair, whose sequences are cut from their end).

    >>> fit_lengths([80, 90], limit=100), fit_lengths([10], limit=4)
    ([50, 50], [4])
    """
    out = list(lengths)
    remaining = limit
    order = sorted(range(len(out)), key=out.__getitem__)
    for k, i in enumerate(order):
        out[i] = min(out[i], remaining // (len(order) - k))
        remaining -= out[i]
    return out


def cut_sequences(values: list[int], lengths: Sequence[int], kept: Sequence[int]) -> list[int]:
    """Concatenated sequences of `lengths`, each cut to its `kept` length.

    >>> cut_sequences([1, 2, 3, 4, 5], [2, 3], [1, 2])
    [1, 3, 4]
    """
    out, start = [], 0
    for n, keep in zip(lengths, kept, strict=True):
        out += values[start : start + keep]
        start += n
    return out


def _columns(
    ids: list[int],
    labels: list[int],
    extra: dict[str, Any],
    *,
    drop: str = "",
    field: str = "",
    detail: str = "",
    num_tokens: int = 0,
    truncated: bool = False,
) -> dict[str, Any]:
    """The map's columns of one row (source_row aside)."""
    internal = {
        "_drop": drop,
        "_field": field,
        "_detail": detail,
        "_num_tokens": num_tokens,
        "_truncated": truncated,
    }
    return {"input_ids": ids, "labels": labels, **extra, **internal}


def _empty(feature: Any) -> Any:
    """The value of a per-example column for a row that has none (a dropped row)."""
    if isinstance(feature, datasets.List):
        return []
    return False if feature.dtype == "bool" else 0


def _damaged(mark: str) -> BadRow:
    """The bad row of a placeholder for a damaged line (its reason and description from the mark)."""
    reason, detail = damage.parse_mark(mark)
    return BadRow("", reason, detail)


def bad_row_error(label: str, entry: Any, row: int, drop: str, field: str, detail: str) -> DataError:
    """The error for a bad row (dataset, row, field, what is wrong, and how to fix or skip it)."""
    where = f"field {field!r}: " if field else ""
    fix = (
        "Fix the data (or the field mappings of this entry), or set data.on_bad_row: skip to drop "
        "such rows (they are counted in the manifest, or with data.streaming in progress.jsonl)."
    )
    if drop == f"bad_row:{TEMPLATE_WITHOUT_TOOLS}":
        fix = "Every row with tools would lose them: use a chat template that renders tools."
    if drop == f"bad_row:{images.IMAGES_NEED_VLM}":
        fix = "Every row with images would lose them."
    return DataError(f"{label} ({entry.path}): row {row}: {where}{detail}. {fix}")


def too_long_error(label: str, entry: Any, row: int, num_tokens: int, limit: int) -> DataError:
    """The error for a row longer than the limit under excess_length_strategy: raise."""
    where = f"{label}.max_seq_len" if entry.max_seq_len else "data.sequence_len"
    return DataError(
        f"{label} ({entry.path}): row {row} is {num_tokens} tokens, longer than "
        f"the limit of {limit} ({where}). Options: raise {where}, or set data.excess_length_strategy "
        "to drop (skip such rows, counted) or truncate (cut them to the limit)."
    )


# ------------------------------------------------------------------------------------------ streaming


def tokenize_stream(
    ds: datasets.IterableDataset,
    entry: Any,
    tokenizer: Any,
    *,
    sequence_len: int,
    excess_length_strategy: str,
    chat_template: str | None = None,
    entry_label: str = "data.datasets[0]",
) -> datasets.IterableDataset:
    """``ds`` tokenized on the fly (data.streaming) by the same batch function as `tokenize_dataset`,
    so a streamed example is token-identical to a prepared one. Rows are not filtered here: every
    row keeps its ``_drop`` reason (and ``_field``, ``_detail``, ``_num_tokens``) for the stream's
    accounting (finetune.data.batching.streaming), which raises or counts them as data.on_bad_row says.
    """
    fmt = format_of(entry)
    # A streamed JSON source knows its columns only once a row is read: datasets' _resolve_features
    # reads the first one (no public call does), so a missing column fails here, before training.
    if ds.features is None:
        ds = ds._resolve_features()
    registry.check_columns(entry, ds.column_names, features=ds.features, entry_label=entry_label)
    renders_chat = fmt.renders_chat(entry, ds.features)
    enc = _encoder(entry, fmt, tokenizer, chat_template, entry_label, chat=renders_chat)
    features = _features(fmt)
    fn = _batch_function(fmt, entry, enc, features, entry.max_seq_len or sequence_len, excess_length_strategy)
    return ds.map(
        fn,
        batched=True,
        batch_size=BATCH_SIZE,
        with_indices=True,
        remove_columns=ds.column_names,
        features=features,
    )


# ---------------------------------------------------------------------------------------- accounting


def _sample_rows(drop: np.ndarray, details: Any) -> list[int]:
    """The first MAX_BAD_ROW_SAMPLES rows of each drop reason whose rows carry a detail, in row order."""
    has_detail = np.asarray(pc.not_equal(details, "").to_numpy(zero_copy_only=False), dtype=bool)
    picked: list[int] = []
    for reason in dict.fromkeys(drop[has_detail].tolist()):
        picked += np.flatnonzero(has_detail & (drop == reason))[:MAX_BAD_ROW_SAMPLES].tolist()
    return sorted(picked)


def _account(
    out: datasets.Dataset, entry: Any, label: str, *, limit: int, strategy: str, on_bad_row: str
) -> TokenizeResult:
    """Count drops, raise for the first bad or too-long row when asked to, filter once."""
    table = out.data  # the map output has no indices mapping: rows line up with the table
    drop = np.asarray(table.column("_drop").to_pylist(), dtype=object)
    keep = drop == ""
    rows_in = len(out)
    dropped = dict(sorted(Counter(drop[~keep].tolist()).items()))
    is_bad = np.char.startswith(drop.astype(str), "bad_row:")
    if (
        on_bad_row == "skip"
    ):  # the template or the model is at fault for these, not the rows: skipping can't help
        is_bad = np.isin(drop, [f"bad_row:{r}" for r in ALWAYS_RAISED])
    first_bad = int(np.argmax(is_bad)) if is_bad.any() else None
    too_long = drop == TOO_LONG
    first_long = int(np.argmax(too_long)) if too_long.any() and strategy == "raise" else None
    source = table.column("source_row")
    if first_bad is not None and (first_long is None or first_bad < first_long):
        row = out[first_bad]
        raise bad_row_error(label, entry, row["source_row"], row["_drop"], row["_field"], row["_detail"])
    if first_long is not None:
        num_tokens = table.column("_num_tokens")[first_long].as_py()
        raise too_long_error(label, entry, source[first_long].as_py(), num_tokens, limit)
    samples = [
        {
            "dataset": label,
            "row": source[k].as_py(),
            "field": table.column("_field")[k].as_py(),
            "reason": drop[k].removeprefix("bad_row:"),
            "detail": table.column("_detail")[k].as_py(),
        }
        for k in _sample_rows(drop, table.column("_detail"))
    ]
    truncated = int(np.asarray(table.column("_truncated").to_numpy(zero_copy_only=False))[keep].sum())
    kept = out if keep.all() else out.select(np.flatnonzero(keep))
    return TokenizeResult(
        dataset=kept.remove_columns(_INTERNAL),
        rows_in=rows_in,
        dropped=dropped,
        truncated=truncated,
        bad_row_samples=samples,
    )
