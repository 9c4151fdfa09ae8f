"""The tokenized format: ids and labels passed through after checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from finetune.data.formats import tokenized

ENC = SimpleNamespace(vocab_size=10)  # the one thing of an Encoder the format reads


def test_ids_pass_through_and_labels_default_to_ids() -> None:
    out = tokenized.tokenize({"input_ids": [[1, 2, 3]]}, None, ENC)
    assert out == [([1, 2, 3], [1, 2, 3])]
    out = tokenized.tokenize({"input_ids": [[1, 2, 3]], "labels": [[-100, 2, 3]]}, None, ENC)
    assert out == [([1, 2, 3], [-100, 2, 3])]
    assert tokenized.columns(None, ["input_ids", "labels"]) == {"input_ids": "input_ids", "labels": "labels"}
    assert tokenized.columns(None, ["input_ids"]) == {"input_ids": "input_ids"}


@pytest.mark.parametrize(
    ("row", "field", "reason"),
    [
        ({"input_ids": None}, "input_ids", "missing_field"),  # was a TypeError inside the map
        ({"input_ids": None, "labels": [1]}, "input_ids", "missing_field"),
        ({"input_ids": "1 2", "labels": [1]}, "input_ids", "wrong_type"),
        ({"input_ids": [1.5], "labels": [1]}, "input_ids", "wrong_type"),
        ({"input_ids": [10], "labels": [1]}, "input_ids", "out_of_vocab"),
        ({"input_ids": [1], "labels": [-1]}, "labels", "out_of_vocab"),
        ({"input_ids": [1, 2], "labels": [1]}, "labels", "length_mismatch"),
    ],
)
def test_bad_rows(row: dict, field: str, reason: str) -> None:
    [bad] = tokenized.tokenize({k: [v] for k, v in row.items()}, None, ENC)
    assert (bad.field, bad.reason) == (field, reason)
