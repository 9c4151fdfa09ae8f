"""``completion``: one column of raw text, trained whole.

A row ``{"text": "The cat sat on the mat."}`` becomes ``[bos] The cat sat on the mat. eos`` with
every token trained (the eos unless ``train_on_eos: none``); the column is ``field_text``.

>>> from types import SimpleNamespace as NS
>>> texts({"body": ["The cat sat.", None]}, NS(field_text="body"))[0]
'The cat sat.'
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from finetune.data.formats import encode
from finetune.data.formats.encode import Encoder
from finetune.data.formats.rows import BadRow, Example, text


def columns(entry: Any, column_names: Sequence[str]) -> dict[str, str]:
    """{entry field: column} of the columns read."""
    return {"field_text": entry.field_text}


def texts(batch: dict[str, list], entry: Any) -> list[str | BadRow]:
    """The text of each row."""
    return [text(v, entry.field_text) for v in batch[entry.field_text]]


def tokenize(batch: dict[str, list], entry: Any, enc: Encoder) -> list[Example | BadRow]:
    """``[bos] text eos`` per row (encode.text_examples)."""
    return encode.text_examples(texts(batch, entry), enc, train_eos=entry.train_on_eos != "none")
