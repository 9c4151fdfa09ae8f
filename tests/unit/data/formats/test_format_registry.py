"""The format registry: column checks of every type, through the format an entry's type names."""

from __future__ import annotations

import pytest

from finetune.data import formats
from finetune.errors import DataError
from finetune.recipe import DatasetEntry


def entry(**kw) -> DatasetEntry:
    kw.setdefault("path", "data/x.jsonl")
    return DatasetEntry(**kw)


def test_check_columns_missing_with_did_you_mean() -> None:
    e = entry(type="input_output", field_prompt="questoin", field_completion="answer")
    with pytest.raises(DataError) as err:
        formats.check_columns(e, ["question", "answer"], entry_label="data.datasets[2]")
    msg = str(err.value)
    assert "data.datasets[2]" in msg and "data/x.jsonl" in msg
    assert "'questoin'" in msg and "['question', 'answer']" in msg
    assert "Did you mean 'question'?" in msg
    assert "data.datasets[2].field_prompt" in msg


def test_check_columns_each_type() -> None:
    formats.check_columns(entry(type="completion"), ["text"])
    formats.check_columns(entry(type="alpaca"), ["instruction", "output"])  # input is optional
    formats.check_columns(entry(type="alpaca"), ["instruction", "input", "output"])
    formats.check_columns(entry(type="chat_template"), ["messages", "id"])
    formats.check_columns(entry(type="tokenized"), ["input_ids"])
    formats.check_columns(entry(type="preference"), ["chosen", "rejected"])  # prompt is optional
    formats.check_columns(entry(type="kto"), ["prompt", "completion", "label"])
    with pytest.raises(DataError, match="'text'"):
        formats.check_columns(entry(type="completion"), ["content"])
    with pytest.raises(DataError, match="'input_ids'"):
        formats.check_columns(entry(type="tokenized"), ["ids", "labels"])
    # An explicitly mapped input column must exist: no silent fallback to "no input".
    with pytest.raises(DataError, match="'context'"):
        formats.check_columns(entry(type="alpaca", field_input="context"), ["instruction", "output"])
    with pytest.raises(DataError, match="'label'"):
        formats.check_columns(entry(type="kto"), ["prompt", "completion"])


def test_image_types_have_no_llm_format() -> None:
    with pytest.raises(DataError, match="unknown dataset type 'images'"):
        formats.format_of(entry(type="images"))
