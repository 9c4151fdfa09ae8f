"""The completion format: one text column."""

from __future__ import annotations

from finetune.data.formats import completion
from finetune.recipe import dataset_entry


def test_texts_and_bad_rows() -> None:
    e = dataset_entry(path="data/x.jsonl", type="completion", field_text="body")
    out = completion.texts({"body": ["hello", None, 3]}, e)
    assert out[0] == "hello"
    assert [(b.field, b.reason) for b in out[1:]] == [("body", "missing_field"), ("body", "wrong_type")]
    assert completion.columns(e, ["body", "id"]) == {"field_text": "body"}
