"""The data formats of LLM dataset entries: one module per `type`, found through `FORMATS`.

Every format reduces a batch of raw rows to one of a few shapes and tokenizes it with a path the
formats share (finetune/data/formats/encode.py, chat.py, images.py; the kto format shares preference.py's):

* ``completion``: one text, trained whole.
* ``alpaca`` and ``input_output``: a (prompt, completion) pair, the prompt masked unless
  ``train_on_inputs``; with ``apply_chat_template`` a user turn and an assistant turn.
* ``chat_template``: a list of messages rendered by the chat template.
* ``tokenized``: ids (and labels) as they are, after checks.
* ``preference`` and ``kto``: a prompt and completions (a chosen and a rejected one; one labelled
  desirable or not), strings or lists of messages.
* ``prompt``: a prompt alone (online RL samples the completions), its row kept for the rewards.

A `Format` is what tokenize.py asks of a type: the columns it reads, how a batch becomes token ids
and labels, whether its rows go through the chat template, and its per-example columns. The rows
of a format are never raised on: a malformed one is a ``BadRow`` (finetune/data/formats/rows.py).

Adding a format (say ``tools``) touches:

1. finetune/recipe/formats.py: its schema class (``type: Literal["tools"]`` and the fields it
   reads), added to ``ENTRY_CLASSES``;
2. finetune/data/formats/tools.py: a docstring with a row of the format, ``columns`` and
   ``tokenize`` (and ``renders_chat`` / ``check`` / ``FEATURES`` when it needs them), using the
   shared paths where they fit;
3. this module: its entry in ``FORMATS``;
4. tests/unit/data/formats/test_tools_format.py, and a row of it in ROWS of
   tests/unit/data/formats/test_format_registry.py, which checks that the registry and the recipe's
   entry classes agree and that every type tokenizes a row of its schema's defaults.

>>> from types import SimpleNamespace as NS
>>> sorted(columns_read(NS(type="alpaca", field_instruction="q", field_output="a", field_input="ctx"), ["q", "a"]))
['field_instruction', 'field_output']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import datasets

from finetune.data.formats import (
    alpaca,
    chat_template,
    completion,
    input_output,
    kto,
    preference,
    prompt,
    tokenized,
)
from finetune.data.formats.encode import Encoder
from finetune.data.formats.rows import BadRow, Example, missing_name_message
from finetune.errors import DataError


def _never(entry: Any, features: datasets.Features) -> bool:
    return False


@dataclass(frozen=True)
class Format:
    """What tokenizing a dataset entry of one type needs to know of its format."""

    columns: Callable[[Any, Sequence[str]], dict[str, str]]
    """(entry, the data's column names) -> {entry field: column} of the columns read (optional
    ones only when present or named by the recipe)."""
    tokenize: Callable[[dict[str, list], Any, Encoder], list[Example | BadRow]]
    """(a batch of raw rows, entry, encoder) -> per row, (input_ids, labels[, per-example columns])
    or the BadRow saying why the row can't be used."""
    renders_chat: Callable[[Any, datasets.Features], bool] = _never
    """(entry, the data's features) -> whether rows are rendered with the chat template (which then
    must exist, with a fast tokenizer)."""
    check: Callable[[Any, datasets.Features, str], None] | None = None
    """(entry, features, entry label) -> raise a DataError for what the features show is missing
    (chat_template: the message keys)."""
    features: Mapping[str, datasets.Value] = field(default_factory=dict)
    """Per-example columns besides input_ids and labels."""
    appends_eos: bool = True
    """Whether rows not rendered with a chat template end with the tokenizer's eos."""
    trained: bool = True
    """Whether its rows carry the trained tokens (a row without any is dropped and counted); prompts
    for online RL carry none: the model's sampled completions are trained."""


FORMATS: dict[str, Format] = {
    "completion": Format(completion.columns, completion.tokenize),
    "alpaca": Format(alpaca.columns, alpaca.tokenize, alpaca.renders_chat),
    "input_output": Format(input_output.columns, input_output.tokenize, input_output.renders_chat),
    "chat_template": Format(
        chat_template.columns, chat_template.tokenize, chat_template.renders_chat, chat_template.check
    ),
    "tokenized": Format(tokenized.columns, tokenized.tokenize, appends_eos=False),
    "preference": Format(
        preference.columns, preference.tokenize, preference.renders_chat, features=preference.FEATURES
    ),
    "kto": Format(kto.columns, kto.tokenize, kto.renders_chat, features=kto.FEATURES),
    "prompt": Format(
        prompt.columns,
        prompt.tokenize,
        prompt.renders_chat,
        features=prompt.FEATURES,
        appends_eos=False,
        trained=False,
    ),
}
"""The format of each LLM dataset type (images and dreambooth entries are finetune/diffusion's)."""


def format_of(entry: Any) -> Format:
    """The Format of an entry's type (DataError for a type that has none, e.g. images)."""
    try:
        return FORMATS[entry.type]
    except KeyError:
        raise DataError(f"unknown dataset type {entry.type!r}") from None


def columns_read(entry: Any, column_names: Sequence[str]) -> dict[str, str]:
    """The columns an entry's format reads, as {entry attribute: column name}.

    Optional columns are included only when present, except when the user set the mapping
    explicitly (then a missing one is an error, not a silent fallback).
    """
    return format_of(entry).columns(entry, column_names)


def check_columns(
    entry: Any, column_names: Sequence[str], *, features: Any = None, entry_label: str = "data.datasets[0]"
) -> None:
    """Raise a DataError when a column (or message key) the entry's mapping names doesn't exist.

    ``features`` (a ``datasets.Features``) lets chat entries check the message keys up front when
    the messages column is a list of structs.
    """
    for attr, column in columns_read(entry, column_names).items():
        if column not in column_names:
            raise DataError(missing_name_message(entry_label, entry.path, attr, column, list(column_names)))
    check = format_of(entry).check
    if check is not None and features is not None:
        check(entry, features, entry_label)
