"""Tokenize formatted rows into ``input_ids`` and ``labels`` (-100 where nothing is trained).

Conventions (the packing and the loss rely on them):

* ``labels`` are aligned with ``input_ids`` (the Hugging Face convention: the loss shifts), and
  ``labels[0]`` is always -100 because the first token is never predicted. Counting the tokens
  with a label therefore gives exactly the number of loss terms, in a packed row too.
* ``completion``: ``[bos] text eos``, all trained. ``alpaca`` / ``input_output``:
  ``[bos] prompt completion eos`` with the prompt masked unless ``train_on_inputs``. The prompt
  and the completion are tokenized separately and their ids concatenated, so no token straddles
  the boundary and the mask is exact. ``bos`` is whatever the tokenizer itself adds (its
  post-processor); the eos is trained unless ``train_on_eos: none``.
* ``chat_template`` (and ``alpaca`` / ``input_output`` with ``apply_chat_template``, as a user
  and an assistant turn): see `chat_spans` for how the trained character spans are found; tokens
  are trained when they overlap a trained span (found through the fast tokenizer's offsets). The
  tokenizer's own bos is prepended when the rendered text doesn't start with it already.
  ``train_on_inputs: true`` trains every token of the conversation.
* ``tokenized``: ``input_ids`` (and optional ``labels``) pass through after checks.
* ``preference``: one example per pair, the chosen sequence then the rejected one in
  ``input_ids`` / ``labels`` (each ``[bos] prompt completion eos``, prompt masked) with
  ``chosen_len`` saying where the rejected one starts; ``kto``: ``[bos] prompt completion eos``
  with ``desirable`` and ``prompt_len``. String prompts are tokenized once for both completions;
  chat-rendered pairs (message lists, or ``apply_chat_template``) train only the completion's turns,
  and the shared conversation prefix must give the same tokens before both (else a bad row,
  ``prefix_mismatch``). The length limit applies to the pair (chosen + rejected), the unit that is
  packed and never split; ``truncate`` shortens the longer sequence(s) from their end
  (`finetune.data.preference.fit_lengths`). Both sequences must keep a trained token.

Rows loaded as placeholders for damaged lines (marked in ``damage.BAD_ROW_COLUMN``, see
sources.py) become bad rows here, so they are raised or counted like any other.

Every input row is accounted for: ``rows_in == len(dataset) + sum(dropped.values())``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow.compute as pc
from datasets.fingerprint import Hasher

from finetune.constants import IGNORE_INDEX
from finetune.data import damage, formats, preference
from finetune.data.formats import BadRow
from finetune.errors import DataError

BATCH_SIZE = 1000
# Below this many rows, formats other than chat run in one process: the Rust tokenizer already
# spreads a batch over every core, and starting workers (each gets a pickled copy of the
# tokenizer) costs more than the Python work they would share. Chat rendering is Python-bound.
MIN_ROWS_FOR_PROCESSES = 100_000
MAX_BAD_ROW_SAMPLES = 10  # per reason

# Bad-row reasons specific to pre-tokenized rows and to templates.
OUT_OF_VOCAB = "out_of_vocab"
LENGTH_MISMATCH = "length_mismatch"
TEMPLATE_MISMATCH = "template_mismatch"
PREFIX_MISMATCH = "prefix_mismatch"

# Drop reasons besides "bad_row:<reason>".
TOO_LONG = "too_long"
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
# Per-example columns of preference pairs and kto examples (see the module docstring).
_EXTRA_FEATURES = {
    "preference": {"chosen_len": datasets.Value("int32")},
    "kto": {"desirable": datasets.Value("bool"), "prompt_len": datasets.Value("int32")},
}
_EXTRA_EMPTY = {"chosen_len": 0, "desirable": False, "prompt_len": 0}


def _features(entry: Any) -> datasets.Features:
    return datasets.Features({**_FEATURES, **_EXTRA_FEATURES.get(entry.type, {})})


@dataclass
class TokenizeResult:
    """The tokenized rows of one dataset entry and what happened to the others."""

    # input_ids, labels (list[int]), source_row (row index in the source); preference: chosen_len;
    # kto: desirable, prompt_len
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
) -> TokenizeResult:
    """Tokenize and label every row of ``ds`` as ``entry.type`` says; apply the length policy.

    The limit is ``entry.max_seq_len`` when set, else ``sequence_len``. Longer rows are dropped
    ("too_long"), truncated, or raise, per ``excess_length_strategy`` (drop|truncate|raise).
    Malformed rows raise a DataError naming the row, or with ``on_bad_row="skip"`` are dropped and
    counted ("bad_row:<reason>"). Rows left with no trained token are dropped
    ("no_trainable_tokens").
    """
    if excess_length_strategy not in ("drop", "truncate", "raise"):
        raise ValueError(
            f"excess_length_strategy must be drop, truncate or raise, not {excess_length_strategy!r}"
        )
    if on_bad_row not in ("raise", "skip"):
        raise ValueError(f"on_bad_row must be raise or skip, not {on_bad_row!r}")
    formats.check_columns(entry, ds.column_names, features=ds.features, entry_label=entry_label)
    limit = entry.max_seq_len or sequence_len
    features = _features(entry)
    if len(ds) == 0:  # datasets skips the function on an empty dataset: no columns would exist
        public = datasets.Features({k: v for k, v in features.items() if k not in _INTERNAL})
        return TokenizeResult(datasets.Dataset.from_dict({k: [] for k in public}, features=public), rows_in=0)
    chat = renders_chat(entry) or _has_messages(entry, ds)
    settings = _settings(entry, tokenizer, chat_template, entry_label, chat=chat)
    fn = _BatchTokenizer(entry, tokenizer, settings, limit, excess_length_strategy)
    num_proc = _worth_processes("chat_template" if chat else entry.type, len(ds), num_proc)
    out = ds.map(
        fn,
        batched=True,
        batch_size=BATCH_SIZE,
        with_indices=True,
        remove_columns=ds.column_names,
        features=features,
        num_proc=num_proc,
        new_fingerprint=_map_fingerprint(ds, entry, tokenizer, settings, limit, excess_length_strategy),
        desc=f"Tokenizing {entry_label}",
    )
    return _account(
        out, entry, entry_label, limit=limit, strategy=excess_length_strategy, on_bad_row=on_bad_row
    )


# ------------------------------------------------------------------------------------------ settings


def _worth_processes(kind: str, num_rows: int, num_proc: int | None) -> int | None:
    """``num_proc`` for the map, or None (one process) where workers would only add overhead."""
    if not num_proc or num_proc < 2 or num_rows <= BATCH_SIZE:
        return None
    if kind != "chat_template" and num_rows < MIN_ROWS_FOR_PROCESSES:
        return None
    return min(num_proc, -(-num_rows // BATCH_SIZE))


def _map_fingerprint(
    ds: datasets.Dataset, entry: Any, tokenizer: Any, settings: dict, limit: int, strategy: str
) -> str:
    """The datasets-cache fingerprint of the map, from what its output depends on.

    Passed explicitly because datasets would otherwise hash the map function by pickling the
    tokenizer (about as slow as tokenizing GSM8K). The source of this module and of formats.py is
    included so that a code change never reuses a stale cache.
    """
    if getattr(tokenizer, "is_fast", False):
        vocab: Any = tokenizer.backend_tokenizer.to_str()
    else:
        vocab = sorted(tokenizer.get_vocab().items())
    dump = entry.model_dump(mode="json") if hasattr(entry, "model_dump") else dict(vars(entry))
    code = [Path(formats.__file__).read_bytes(), Path(__file__).read_bytes()]
    state = [type(tokenizer).__name__, vocab, tokenizer.special_tokens_map, tokenizer.chat_template]
    return Hasher.hash([ds._fingerprint, dump, state, settings, limit, strategy, code])


def renders_chat(entry: Any) -> bool:
    """Whether the entry's rows are rendered with the chat template (preference and kto rows also when
    their columns hold messages, see `_has_messages`)."""
    return entry.type == "chat_template" or (
        entry.type in ("alpaca", "input_output", "preference", "kto") and entry.apply_chat_template
    )


def _has_messages(entry: Any, ds: datasets.Dataset) -> bool:
    """Whether a preference / kto entry has a column of message lists (rendered with the template)."""
    if entry.type not in ("preference", "kto"):
        return False
    columns = formats.columns_read(entry, ds.column_names).values()
    return any(isinstance(ds.features.get(c), (datasets.List, datasets.LargeList)) for c in columns)


def _settings(
    entry: Any, tokenizer: Any, chat_template: str | None, entry_label: str, *, chat: bool = False
) -> dict[str, Any]:
    """What the batch function needs besides the entry, computed once (and checked) up front."""
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    # The ids the tokenizer puts before a text by itself (usually [bos] or nothing).
    start = next((k for k in range(len(with_special)) if with_special[k : k + len(plain)] == plain), 0)
    settings: dict[str, Any] = {"prefix_ids": list(with_special[:start]), "eos_id": tokenizer.eos_token_id}
    if chat or renders_chat(entry):
        settings["chat_template"] = _check_chat(entry, tokenizer, chat_template, entry_label)
    if not chat and entry.type in _APPENDS_EOS and tokenizer.eos_token_id is None:
        raise DataError(
            f"{entry_label}: the tokenizer has no eos token, which type {entry.type!r} appends to every "
            "row; set model.special_tokens.eos_token"
        )
    if entry.type == "tokenized":
        settings["vocab_size"] = len(tokenizer)
    return settings


def _check_chat(entry: Any, tokenizer: Any, chat_template: str | None, entry_label: str) -> str | None:
    """The template override for a chat-rendered entry, after checking the tokenizer and roles."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            f"{entry_label}: chat masking needs a fast (Rust) tokenizer for its offset mapping; "
            f"{type(tokenizer).__name__} is not one. Save the tokenizer with a tokenizer.json."
        )
    if not (chat_template or tokenizer.chat_template):
        raise DataError(
            f"{entry_label}: {_chat_kind(entry)} needs a chat template, but the tokenizer has none; "
            "set model.chat_template (a Jinja string or a known name such as chatml or llama2)"
        )
    known = formats.known_roles(entry)
    unknown = [r for r in entry.roles_to_train if r not in known]
    if unknown:
        mapped = {k: v for k, v in entry.role_map.items() if k in unknown}
        hint = f" role_map renames {mapped}: name the roles it maps to." if mapped else ""
        raise DataError(
            f"{entry_label}.roles_to_train: {unknown} not among the roles messages have after role_map "
            f"({', '.join(sorted(known))}), so nothing of theirs would be trained.{hint}"
        )
    return chat_template


_APPENDS_EOS = ("completion", "alpaca", "input_output", "preference", "kto")


def _chat_kind(entry: Any) -> str:
    if entry.type in ("chat_template", "preference", "kto") and not entry.apply_chat_template:
        return f"type {entry.type} with messages"
    return "apply_chat_template"


# ------------------------------------------------------------------------------------- batch function


class _BatchTokenizer:
    """The ``ds.map`` function: a batch of raw rows -> ids, labels and a drop reason per row.

    Rows are never removed inside the map (one select after it keeps the rest), so that
    every row's fate is recorded in the ``_drop`` column and counted.
    """

    def __init__(self, entry: Any, tokenizer: Any, settings: dict[str, Any], limit: int, strategy: str):
        self.entry, self.tokenizer, self.settings = entry, tokenizer, settings
        self.limit, self.strategy = limit, strategy

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        kind = self.entry.type
        if kind in ("preference", "kto"):
            rows = self._completions(
                formats.preference_rows(batch, self.entry)
                if kind == "preference"
                else formats.kto_rows(batch, self.entry)
            )
        elif kind == "completion":
            rows = self._completion(batch)
        elif kind == "chat_template":
            rows = self._chat(formats.conversations(batch, self.entry))
        elif renders_chat(self.entry):
            rows = self._chat(formats.pair_conversations(batch, self.entry))
        elif kind in ("alpaca", "input_output"):
            rows = self._prompt_completion(batch)
        else:
            rows = self._tokenized(batch)
        if damage.BAD_ROW_COLUMN in batch:  # placeholders for damaged lines (see sources.py)
            rows = [
                _damaged(mark) if mark else row
                for row, mark in zip(rows, batch[damage.BAD_ROW_COLUMN], strict=True)
            ]
        return self._finish(rows, indices)

    def _ids(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens, in one call for the whole batch."""
        return [e.ids for e in self._encode(texts, offsets=False)]

    def _encode(self, texts: list[str], *, offsets: bool) -> list[Any]:
        """``tokenizers.Encoding`` per text (a batch call: the Rust tokenizer uses every core).

        The transformers wrapper costs about twice the tokenization itself in Python conversions,
        so the backend is called directly once the wrapper has set its state (no truncation or
        padding, its split_special_tokens choice) with a call on an empty string.
        """
        if not getattr(self.tokenizer, "is_fast", False):
            ids = self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
            return [_Ids(x) for x in ids]
        self.tokenizer("", add_special_tokens=False)
        backend = self.tokenizer.backend_tokenizer
        if offsets:
            return backend.encode_batch(texts, add_special_tokens=False)
        return backend.encode_batch_fast(texts, add_special_tokens=False)

    def _train_eos(self) -> bool:
        return self.entry.train_on_eos != "none"

    def _completion(self, batch: dict[str, list]) -> list[tuple[list[int], list[int]] | BadRow]:
        texts = formats.completion_texts(batch, self.entry)
        all_ids = self._ids([t if isinstance(t, str) else "" for t in texts])
        prefix, eos = self.settings["prefix_ids"], self.settings["eos_id"]
        rows: list[tuple[list[int], list[int]] | BadRow] = []
        for text, ids in zip(texts, all_ids, strict=True):
            if isinstance(text, BadRow):
                rows.append(text)
                continue
            ids = [*prefix, *ids, eos]
            rows.append((ids, [*ids[:-1], eos if self._train_eos() else IGNORE_INDEX]))
        return rows

    def _prompt_completion(self, batch: dict[str, list]) -> list[tuple[list[int], list[int]] | BadRow]:
        pairs = formats.prompt_completion_pairs(batch, self.entry)
        ok = [p if isinstance(p, tuple) else ("", "") for p in pairs]
        prompt_ids = self._ids([p for p, _ in ok])
        completion_ids = self._ids([c for _, c in ok])
        prefix, eos = self.settings["prefix_ids"], self.settings["eos_id"]
        end = eos if self._train_eos() else IGNORE_INDEX
        rows: list[tuple[list[int], list[int]] | BadRow] = []
        for pair, p_ids, c_ids in zip(pairs, prompt_ids, completion_ids, strict=True):
            if isinstance(pair, BadRow):
                rows.append(pair)
                continue
            ids = [*prefix, *p_ids, *c_ids, eos]
            if self.entry.train_on_inputs:
                labels = [*ids[:-1], end]
            else:
                labels = [IGNORE_INDEX] * (len(prefix) + len(p_ids)) + [*c_ids, end]
            rows.append((ids, labels))
        return rows

    def _chat(self, convs: list[list[dict[str, Any]] | BadRow]) -> list[tuple[list[int], list[int]] | BadRow]:
        entry, template = self.entry, self.settings["chat_template"]

        def render(messages: list[dict[str, Any]]) -> str:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template)

        field = self._messages_field()
        texts: list[str] = []
        found: list[list[tuple[int, int]] | BadRow] = []
        for conv in convs:
            text, spans = "", conv if isinstance(conv, BadRow) else _empty_turns(conv, entry, field)
            if spans is None:
                try:
                    if entry.train_on_inputs:
                        text, spans = _render(render, conv), []
                    else:
                        text, spans = chat_spans(
                            conv, render, roles_to_train=entry.roles_to_train, train_on_eos=entry.train_on_eos
                        )
                except ChatTemplateError as e:
                    spans = BadRow(field, e.reason, str(e))
            texts.append(text)
            found.append(spans)
        rows: list[tuple[list[int], list[int]] | BadRow] = []
        for spans, encoding in zip(found, self._encode(texts, offsets=True), strict=True):
            if isinstance(spans, BadRow):
                rows.append(spans)
            else:
                rows.append(self._labelled(encoding, None if entry.train_on_inputs else spans))
        return rows

    def _labelled(self, encoding: Any, spans: list[tuple[int, int]] | None) -> tuple[list[int], list[int]]:
        """(ids, labels) of a rendered text: tokens overlapping a trained span get labels (every token
        when `spans` is None), and the tokenizer's bos goes first unless the text starts with it."""
        ids = encoding.ids
        if spans is None:
            labels = list(ids)
        else:
            labels = [IGNORE_INDEX] * len(ids)
            for a, b in spans:
                t0, t1 = _token_range(encoding, a, b)
                labels[t0:t1] = ids[t0:t1]
        prefix = self.settings["prefix_ids"]
        if prefix and ids[: len(prefix)] != prefix:
            ids, labels = [*prefix, *ids], [IGNORE_INDEX] * len(prefix) + labels
        return ids, labels

    # ------------------------------------------------------------------------ preference and kto

    def _completions(self, rows: list[formats.CompletionsRow | BadRow]) -> list[Any]:
        """Preference pairs / kto examples: strings as ``[bos] prompt completion eos`` (prompt
        tokenized once), message lists (or apply_chat_template) rendered with the chat template."""
        chat = [
            not isinstance(r, BadRow) and (self.entry.apply_chat_template or formats.is_conversational(r))
            for r in rows
        ]
        out: list[Any] = list(rows)
        for is_chat, done in ((False, self._plain_completions), (True, self._chat_completions)):
            picked = [k for k, r in enumerate(rows) if not isinstance(r, BadRow) and chat[k] == is_chat]
            for k, row in zip(picked, done([rows[k] for k in picked]) if picked else [], strict=True):
                out[k] = row
        return out

    def _plain_completions(self, rows: list[formats.CompletionsRow]) -> list[Any]:
        prompts = [
            r.prompt
            if r.prompt is not None
            else formats.shared_text_prefix(r.completions)
            if len(r.completions) > 1
            else ""
            for r in rows
        ]
        texts = [
            c[len(p) :] if r.prompt is None else c
            for r, p in zip(rows, prompts, strict=True)
            for c in r.completions
        ]
        prompt_ids, completion_ids = self._ids(prompts), iter(self._ids(texts))
        prefix, eos = self.settings["prefix_ids"], self.settings["eos_id"]
        end = eos if self._train_eos() else IGNORE_INDEX
        out = []
        for row, p_ids in zip(rows, prompt_ids, strict=True):
            head = [*prefix, *p_ids]
            sequences = []
            for _ in row.completions:
                c_ids = next(completion_ids)
                sequences.append(([*head, *c_ids, eos], [IGNORE_INDEX] * len(head) + [*c_ids, end]))
            out.append(_completions_example(row, sequences, prompt_len=len(head)))
        return out

    def _chat_completions(self, rows: list[formats.CompletionsRow]) -> list[Any]:
        entry, template = self.entry, self.settings["chat_template"]
        field = entry.field_chosen if entry.type == "preference" else entry.field_completion

        def render(messages: list[dict[str, Any]]) -> str:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template)

        out: list[Any] = [None] * len(rows)
        pending = []  # (row index, [(text, spans) per completion])
        for k, row in enumerate(rows):
            convs = formats.completion_conversations(row, field)
            if isinstance(convs, BadRow):
                out[k] = convs
                continue
            shared, completions = convs
            try:
                pending.append((k, [self._render_completion(shared, c, render) for c in completions]))
            except ChatTemplateError as e:
                out[k] = BadRow(field, e.reason, str(e))
        encodings = iter(self._encode([text for _, seqs in pending for text, _ in seqs], offsets=True))
        for k, seqs in pending:
            encs = [next(encodings) for _ in seqs]
            mismatch = preference.shared_prefix_problem(
                [text for text, _ in seqs], [spans for _, spans in seqs], encs
            )
            if mismatch:
                out[k] = BadRow(entry.field_rejected, PREFIX_MISMATCH, mismatch)
                continue
            sequences = [self._labelled(enc, spans) for enc, (_, spans) in zip(encs, seqs, strict=True)]
            labels = sequences[0][1]
            prompt_len = next((t for t, x in enumerate(labels) if x != IGNORE_INDEX), len(labels))
            out[k] = _completions_example(rows[k], sequences, prompt_len=prompt_len)
        return out

    def _render_completion(
        self, shared: list[dict[str, Any]], completion: list[dict[str, Any]], render: Callable
    ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and its trained spans: the completion's turns only."""
        conv = [*shared, *completion]
        roles = self.entry.roles_to_train
        trained = [i for i in range(len(shared), len(conv)) if conv[i]["role"] in roles]
        return chat_spans(
            conv, render, roles_to_train=roles, train_on_eos=self.entry.train_on_eos, trained=trained
        )

    def _messages_field(self) -> str:
        """The column a chat row's problems are reported against."""
        if self.entry.type == "chat_template":
            return self.entry.field_messages
        return self.entry.field_completion if self.entry.type == "input_output" else self.entry.field_output

    def _tokenized(self, batch: dict[str, list]) -> list[tuple[list[int], list[int]] | BadRow]:
        vocab_size = self.settings["vocab_size"]
        labels_col = batch.get("labels")
        rows: list[tuple[list[int], list[int]] | BadRow] = []
        for k, ids in enumerate(batch["input_ids"]):
            bad = _check_ids("input_ids", ids, vocab_size, allow_ignore=False)
            labels = list(ids) if labels_col is None or bad else labels_col[k]
            if not bad and labels_col is not None:
                bad = _check_ids("labels", labels, vocab_size, allow_ignore=True)
                if not bad and len(labels) != len(ids):
                    bad = BadRow(
                        "labels",
                        LENGTH_MISMATCH,
                        f"'labels' has {len(labels)} values but 'input_ids' has {len(ids)}; they must align",
                    )
            rows.append(bad or (list(ids), list(labels)))
        return rows

    def _finish(
        self, rows: list[tuple[list[int], list[int]] | BadRow], indices: list[int]
    ) -> dict[str, list]:
        """Apply labels[0] = -100 (of each sequence), the length policy and the no-trainable-token check."""
        features = _features(self.entry)
        out: dict[str, list] = {name: [] for name in features}
        for row, index in zip(rows, indices, strict=True):
            drop, bad_field, detail, truncated, num_tokens = "", "", "", False, 0
            ids: list[int] = []
            labels: list[int] = []
            extra = {name: _EXTRA_EMPTY[name] for name in features if name in _EXTRA_EMPTY}
            if isinstance(row, BadRow):
                drop, bad_field, detail = row.drop_key, row.field, row.detail
            else:
                ids, labels, *rest = row
                extra.update(rest[0] if rest else {})
                num_tokens = len(ids)
                lengths = (
                    [extra["chosen_len"], num_tokens - extra["chosen_len"]]
                    if "chosen_len" in extra
                    else [num_tokens]
                )
                if num_tokens > self.limit:
                    if self.strategy == "truncate":
                        kept = preference.fit_lengths(lengths, self.limit)
                        ids, labels = (
                            preference.cut_sequences(ids, lengths, kept),
                            preference.cut_sequences(labels, lengths, kept),
                        )
                        lengths, truncated = kept, True
                    else:
                        drop = TOO_LONG
                starts = np.cumsum([0, *lengths[:-1]]).tolist()
                for start in starts if labels else ():
                    labels[start] = IGNORE_INDEX  # the first token of a sequence is never predicted
                if not drop and not all(
                    any(x != IGNORE_INDEX for x in labels[a : a + n])
                    for a, n in zip(starts, lengths, strict=True)
                ):
                    drop = NO_TRAINABLE_TOKENS
                if "chosen_len" in extra:
                    extra["chosen_len"] = lengths[0]
                if drop:
                    ids, labels = [], []
            for name, value in extra.items():
                out[name].append(value)
            for name, value in (
                ("input_ids", ids),
                ("labels", labels),
                ("source_row", index),
                ("_drop", drop),
                ("_field", bad_field),
                ("_detail", detail),
                ("_num_tokens", num_tokens),
                ("_truncated", truncated),
            ):
                out[name].append(value)
        return out


def _completions_example(
    row: formats.CompletionsRow, sequences: list[tuple[list[int], list[int]]], *, prompt_len: int
) -> tuple[list[int], list[int], dict[str, Any]]:
    """One example of a preference pair (chosen then rejected, concatenated) or a kto example."""
    if len(sequences) == 1:
        (ids, labels) = sequences[0]
        return ids, labels, {"desirable": row.desirable, "prompt_len": prompt_len}
    (chosen, chosen_labels), (rejected, rejected_labels) = sequences
    return [*chosen, *rejected], [*chosen_labels, *rejected_labels], {"chosen_len": len(chosen)}


def _damaged(mark: str) -> BadRow:
    """The bad row of a placeholder for a damaged line (its reason and description from the mark)."""
    reason, detail = damage.parse_mark(mark)
    return BadRow("", reason, detail)


def _empty_turns(conv: list[dict[str, Any]], entry: Any, field: str) -> BadRow | None:
    """A drop when every turn to train is empty or whitespace (the row would train only end tokens)."""
    if entry.train_on_inputs:
        return None
    trained = [m["content"] for m in conv if m["role"] in entry.roles_to_train]
    if trained and not any(c.strip() for c in trained):
        roles = "/".join(entry.roles_to_train)
        detail = f"every {roles} turn is empty or whitespace: the row would train nothing"
        return BadRow(field, formats.EMPTY_COMPLETION, detail, malformed=False)
    return None


@dataclass
class _Ids:
    """Stand-in for ``tokenizers.Encoding`` with a slow tokenizer (ids only)."""

    ids: list[int]


def _check_ids(name: str, values: Any, vocab_size: int, *, allow_ignore: bool) -> BadRow | None:
    if values is None:
        return BadRow(name, formats.MISSING_FIELD, f"{name!r} is missing or null")
    if not isinstance(values, list):
        return BadRow(
            name, formats.WRONG_TYPE, f"{name!r} should be a list of ints, got {type(values).__name__}"
        )
    arr = np.asarray(values)
    if arr.size == 0:
        return None
    if arr.dtype.kind not in "iu":
        return BadRow(name, formats.WRONG_TYPE, f"{name!r} should hold only ints (found {arr.dtype} values)")
    valid = (arr >= 0) & (arr < vocab_size)
    if allow_ignore:
        valid |= arr == IGNORE_INDEX
    if not valid.all():
        bad = int(arr[~valid][0])
        allowed = f"-100 or 0..{vocab_size - 1}" if allow_ignore else f"0..{vocab_size - 1}"
        return BadRow(
            name, OUT_OF_VOCAB, f"{name!r} holds {bad}, outside {allowed} (the tokenizer's vocabulary)"
        )
    return None


def _token_range(encoding: Any, start: int, end: int) -> tuple[int, int]:
    """Tokens [t0, t1) that overlap the characters [start, end) (via the offset mapping)."""
    t0 = next((t for c in range(start, end) if (t := encoding.char_to_token(c)) is not None), None)
    if t0 is None:
        return 0, 0
    t1 = next(t for c in range(end - 1, start - 1, -1) if (t := encoding.char_to_token(c)) is not None)
    return t0, t1 + 1


# ------------------------------------------------------------------------------------- chat masking


class ChatTemplateError(Exception):
    """The template rejected a conversation (reason role_rejected) or rendered it in a way the
    masking can't follow (reason template_mismatch)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


# Private-use characters: no tokenizer or template produces them, so a marker can't collide.
_MARK = "\ue000{}\ue001"
_MARK_RE = re.compile("\ue000(\\d+)\ue001")


def chat_spans(
    messages: list[dict[str, Any]],
    render: Callable[[list[dict[str, Any]]], str],
    *,
    roles_to_train: list[str],
    train_on_eos: str = "turn",
    trained: list[int] | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """Render ``messages`` and return (text, the sorted character spans to train).

    The trained turns are the messages whose role is in ``roles_to_train``, or the indices in
    ``trained`` when given (a preference completion's turns, not the prompt's).

    How the spans are found, for any template (ChatML, Llama-2's folded system prompt, BOS in the
    template, ...), without assumptions about its markup:

    1. Content: render the conversation once more with each message's content replaced by a
       unique marker. The text between markers is the template's own markup, so walking both
       renderings side by side gives where each content lies in the real text (the content may be
       stripped by the template). When the walk fails (a template that reacts to the content), a
       rendering with a single marker per message gives its span exactly: the text before the
       marker is the same, and so is the text after the content.
    2. End of turn: a message's turn ends where the rendering of ``messages[:i+1]`` stops being a
       prefix of the full text (the last message's turn ends at the end). What lies between the
       content and that point, without surrounding whitespace, is the end-of-turn text (e.g.
       ``<|im_end|>`` for ChatML, ``</s>`` for Llama-2); it is trained per ``train_on_eos``:
       turn (every trained turn), last (the last trained turn), all (every turn), none.

    The caller trains every token that overlaps a span: a token that merges markup with content
    (Llama's ``▁It`` after ``[/INST] ``) is trained, a markup-only one (a lone ``▁`` before a
    digit, ChatML's ``\n`` after the role) is not.
    """
    full = _render(render, messages)
    if trained is None:
        trained = [i for i, m in enumerate(messages) if m["role"] in roles_to_train]
    eos_turns = {
        "turn": trained,
        "last": trained[-1:],
        "all": list(range(len(messages))),
        "none": [],
    }[train_on_eos]
    if not trained and not eos_turns:
        return full, []
    content = _content_spans(messages, full, render, needed=sorted({*trained, *eos_turns}))
    spans = [content[i] for i in trained if content[i] and content[i][1] > content[i][0]]
    for i in eos_turns:
        if content[i] is None:
            continue
        start = content[i][1]
        if i == len(messages) - 1:
            end = len(full)
        else:
            end = _common_prefix_len(full, _render(render, messages[: i + 1]))
        segment = full[start:end]
        stripped = segment.strip()
        if stripped:
            s = start + len(segment) - len(segment.lstrip())
            spans.append((s, s + len(stripped)))
    return full, sorted(spans)


def _render(render: Callable[[list[dict[str, Any]]], str], messages: list[dict[str, Any]]) -> str:
    try:
        return render(messages)
    except Exception as e:  # the template's own raise_exception, or a Jinja error on odd input
        roles = [m.get("role") for m in messages]
        raise ChatTemplateError(
            formats.ROLE_REJECTED, f"the chat template rejected the conversation (roles {roles}): {e}"
        ) from e


def _content_spans(
    messages: list[dict[str, Any]], full: str, render: Callable, *, needed: list[int]
) -> list[tuple[int, int] | None]:
    marked = [{**m, "content": _MARK.format(i)} for i, m in enumerate(messages)]
    spans = _walk(full, _render(render, marked), messages)
    if spans is not None:
        return spans
    spans = [None] * len(messages)
    for i in needed:
        spans[i] = _exact_span(full, messages, i, render)
    return spans


def _walk(full: str, marked_text: str, messages: list[dict[str, Any]]) -> list[tuple[int, int] | None] | None:
    """Content spans from a side-by-side walk of the real and the marked rendering (None if lost)."""
    hits = list(_MARK_RE.finditer(marked_text))
    spans: list[tuple[int, int] | None] = [None] * len(messages)
    pos, prev = 0, 0  # positions in full and in marked_text
    for k, hit in enumerate(hits):
        literal = marked_text[prev : hit.start()]
        if not full.startswith(literal, pos):
            return None
        pos += len(literal)
        i = int(hit.group(1))
        if i >= len(messages) or spans[i] is not None:
            return None  # a content rendered twice: let the exact method decide
        last = k + 1 == len(hits)
        after = marked_text[hit.end() : len(marked_text) if last else hits[k + 1].start()]
        text = messages[i]["content"]
        for rendered in dict.fromkeys((text, text.strip(), text.rstrip(), text.lstrip())):
            end = pos + len(rendered)
            if full.startswith(rendered, pos) and (
                full[end:] == after if last else full.startswith(after, end)
            ):
                break
        else:
            return None
        spans[i] = (pos, end)
        pos, prev = end, hit.end()
    if not hits and full != marked_text:
        return None
    return spans


def _exact_span(
    full: str, messages: list[dict[str, Any]], i: int, render: Callable
) -> tuple[int, int] | None:
    mark = _MARK.format(i)
    marked = _render(render, [*messages[:i], {**messages[i], "content": mark}, *messages[i + 1 :]])
    at = marked.find(mark)
    if at < 0:
        return None  # the template doesn't show this message
    tail = marked[at + len(mark) :]
    end = len(full) - len(tail)
    if end < at or not full.startswith(marked[:at]) or not full.endswith(tail):
        raise ChatTemplateError(
            TEMPLATE_MISMATCH,
            f"could not locate message {i}'s content in the rendered template (the template changes "
            "its markup with the content); use a template that renders contents verbatim",
        )
    return at, end


def _common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix (string comparisons in C, O(n log n) at worst)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


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
    first_bad = int(np.argmax(is_bad)) if is_bad.any() and on_bad_row == "raise" else None
    too_long = drop == TOO_LONG
    first_long = int(np.argmax(too_long)) if too_long.any() and strategy == "raise" else None
    source = table.column("source_row")
    if first_bad is not None and (first_long is None or first_bad < first_long):
        row = out[first_bad]
        where = f"field {row['_field']!r}: " if row["_field"] else ""
        raise DataError(
            f"{label} ({entry.path}): row {row['source_row']}: {where}{row['_detail']}. "
            "Fix the data (or the field mappings of this entry), or set data.on_bad_row: skip to drop "
            "such rows (they are counted in the manifest)."
        )
    if first_long is not None:
        num_tokens = table.column("_num_tokens")[first_long].as_py()
        where = f"{label}.max_seq_len" if entry.max_seq_len else "data.sequence_len"
        raise DataError(
            f"{label} ({entry.path}): row {source[first_long].as_py()} is {num_tokens} tokens, longer than "
            f"the limit of {limit} ({where}). Options: raise {where}, or set data.excess_length_strategy "
            "to drop (skip such rows, counted) or truncate (cut them to the limit)."
        )
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
