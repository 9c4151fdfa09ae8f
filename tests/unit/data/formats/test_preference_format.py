"""The preference format: (prompt, chosen, rejected) rows of strings or messages, and what cannot train."""

from __future__ import annotations

import datasets

from finetune.data.formats import preference
from finetune.data.formats.preference import CompletionsRow
from finetune.data.formats.rows import IDENTICAL_COMPLETIONS, MISSING_FIELD
from finetune.recipe import DatasetEntry, dataset_entry


def entry(**kw) -> DatasetEntry:
    return dataset_entry(path="pairs.jsonl", type="preference", **kw)


def test_rows_take_strings_and_messages_and_count_what_cannot_train():
    batch = {
        "prompt": ["a?", "b?", None, "d?"],
        "chosen": ["yes", [{"role": "assistant", "content": "fine"}], "x", "same"],
        "rejected": ["no", [{"role": "assistant", "content": "bad"}], "y", "same"],
    }
    rows = preference.rows(batch, entry())
    assert rows[0] == CompletionsRow("a?", ("yes", "no"))
    assert rows[1].completions[0] == [{"role": "assistant", "content": "fine"}]
    assert rows[2].reason == MISSING_FIELD and rows[2].field == "prompt"
    assert rows[3].reason == IDENTICAL_COMPLETIONS and not rows[3].malformed


def test_without_a_prompt_column_the_prompt_is_none():
    rows = preference.rows({"chosen": ["a b"], "rejected": ["a c"]}, entry())
    assert rows == [CompletionsRow(None, ("a b", "a c"))]
    assert preference.columns(entry(), ["chosen", "rejected"]) == {
        "field_chosen": "chosen",
        "field_rejected": "rejected",
    }
    assert "field_prompt" in preference.columns(entry(field_prompt="question"), ["chosen", "rejected"])


def test_message_columns_are_rendered_with_the_chat_template():
    strings = datasets.Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])
    messages = datasets.Dataset.from_list(
        [{"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]}]
    )
    assert not preference.renders_chat(entry(), strings.features)
    assert preference.renders_chat(entry(apply_chat_template=True), strings.features)
    assert preference.renders_chat(entry(), messages.features)
