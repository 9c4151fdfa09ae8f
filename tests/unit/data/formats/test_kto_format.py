"""The kto format: (prompt, completion, label) rows; the label must be a boolean."""

from __future__ import annotations

from finetune.data.formats import kto
from finetune.data.formats.rows import MISSING_FIELD, NOT_A_BOOLEAN
from finetune.recipe import dataset_entry


def test_rows_need_a_boolean_label():
    e = dataset_entry(path="k.jsonl", type="kto")
    rows = kto.rows(
        {"prompt": ["a", "b", "c", "d"], "completion": ["x", "y", "z", "w"], "label": [True, 0, "yes", None]},
        e,
    )
    assert [r.desirable for r in rows[:2]] == [True, False]
    assert rows[2].reason == NOT_A_BOOLEAN and rows[2].field == "label"
    assert rows[3].reason == MISSING_FIELD
    assert [r.completions for r in rows[:2]] == [("x",), ("y",)]
    assert kto.columns(e, ["completion", "label"]) == {
        "field_completion": "completion",
        "field_label": "label",
    }
