"""``tokenized``: rows already made of token ids, passed through after checks.

A row ``{"input_ids": [1, 415, 5255, 2], "labels": [-100, 415, 5255, 2]}``: the columns are always
named ``input_ids`` and (optional) ``labels``; without labels every token is trained. Ids must be in
the tokenizer's vocabulary, labels too (or -100), and both lists as long.

>>> check_ids("input_ids", [1, 2, 70000], vocab_size=32000, allow_ignore=False).reason
'out_of_vocab'
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from finetune.constants import IGNORE_INDEX
from finetune.data.formats.encode import Encoder
from finetune.data.formats.rows import (
    LENGTH_MISMATCH,
    MISSING_FIELD,
    OUT_OF_VOCAB,
    WRONG_TYPE,
    BadRow,
    Example,
)


def columns(entry: Any, column_names: Sequence[str]) -> dict[str, str]:
    """{name: column} of the columns read: input_ids, and labels when the data has them."""
    return {"input_ids": "input_ids"} | ({"labels": "labels"} if "labels" in column_names else {})


def tokenize(batch: dict[str, list], entry: Any, enc: Encoder) -> list[Example | BadRow]:
    """The ids and labels of each row (labels = ids when the data has none), or why they can't be used."""
    vocab_size = enc.vocab_size
    labels_col = batch.get("labels")
    rows: list[Example | BadRow] = []
    for k, ids in enumerate(batch["input_ids"]):
        bad = check_ids("input_ids", ids, vocab_size, allow_ignore=False)
        if bad:
            rows.append(bad)
            continue
        labels = list(ids) if labels_col is None else labels_col[k]
        if labels_col is not None:
            bad = check_ids("labels", labels, vocab_size, allow_ignore=True)
            if not bad and len(labels) != len(ids):
                bad = BadRow(
                    "labels",
                    LENGTH_MISMATCH,
                    f"'labels' has {len(labels)} values but 'input_ids' has {len(ids)}; they must align",
                )
        rows.append(bad or (list(ids), list(labels)))
    return rows


def check_ids(name: str, values: Any, vocab_size: int, *, allow_ignore: bool) -> BadRow | None:
    """Why a column's value is not a list of ids below `vocab_size` (-100 also allowed in labels), or None."""
    if values is None:
        return BadRow(name, MISSING_FIELD, f"{name!r} is missing or null")
    if not isinstance(values, list):
        return BadRow(name, WRONG_TYPE, f"{name!r} should be a list of ints, got {type(values).__name__}")
    arr = np.asarray(values)
    if arr.size == 0:
        return None
    if arr.dtype.kind not in "iu":
        return BadRow(name, WRONG_TYPE, f"{name!r} should hold only ints (found {arr.dtype} values)")
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
