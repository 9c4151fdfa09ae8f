"""The chat_template format: conversation normalization (role_map, keys), bad rows, message keys."""

from __future__ import annotations

import datasets
import pytest

from finetune.data.formats import chat_template
from finetune.data.formats.rows import BadRow
from finetune.errors import DataError
from finetune.recipe import DatasetEntry, dataset_entry


def entry(**kw) -> DatasetEntry:
    return dataset_entry(path="data/x.jsonl", type="chat_template", **kw)


def test_conversation_role_map_sharegpt() -> None:
    e = entry(
        field_messages="conversations",
        message_field_role="from",
        message_field_content="value",
        role_map={"human": "user", "gpt": "assistant", "system": "system"},
    )
    rows = {
        "conversations": [
            [
                {"from": "system", "value": "Be brief."},
                {"from": "human", "value": "Hi"},
                {"from": "gpt", "value": "Hello", "weight": 1},
            ]
        ]
    }
    assert chat_template.conversations(rows, e) == [
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"weight": 1, "role": "assistant", "content": "Hello"},
        ]
    ]


def test_unknown_roles_and_role_map_targets() -> None:
    msgs = [{"role": "ipython", "content": "42"}, {"role": "assistant", "content": "ok"}]
    bad = chat_template.conversation(msgs, entry())
    assert isinstance(bad, BadRow) and bad.reason == "unknown_role" and bad.field == "messages[0].role"
    assert (
        "'ipython'" in bad.detail and "{ipython: ipython}" in bad.detail and "{ipython: user}" in bad.detail
    )
    # A role_map target is a known role: mapping a role to itself declares one the template has.
    ok = chat_template.conversation(msgs, entry(role_map={"ipython": "ipython"}))
    assert [m["role"] for m in ok] == ["ipython", "assistant"]
    mapped = chat_template.conversation(
        [{"role": "human", "content": "a"}], entry(role_map={"human": "humano"})
    )
    assert mapped == [{"role": "humano", "content": "a"}]  # any role_map target is known, by design


def test_conversation_keeps_unmapped_roles_and_drops_null_keys() -> None:
    msgs = [
        {"role": "tool", "content": "42", "name": None},
        {"role": "assistant", "content": "ok", "name": "x"},
    ]
    assert chat_template.conversation(msgs, entry()) == [
        {"role": "tool", "content": "42"},
        {"name": "x", "role": "assistant", "content": "ok"},
    ]


@pytest.mark.parametrize(
    ("value", "field", "reason"),
    [
        (None, "messages", "missing_field"),
        ("hello", "messages", "wrong_type"),
        ([], "messages", "empty_conversation"),
        (["hi"], "messages[0]", "wrong_type"),
        ([{"content": "hi"}], "messages[0].role", "missing_field"),
        ([{"role": "user", "content": "a"}, {"role": "assistant"}], "messages[1].content", "missing_field"),
        ([{"role": "user", "content": None}], "messages[0].content", "missing_field"),
        (
            [{"role": "user", "content": [{"type": "text"}]}],
            "messages[0].content[0]",
            "wrong_type",
        ),  # a part without its text
        ([{"role": 1, "content": "a"}], "messages[0].role", "wrong_type"),
        (
            [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}],
            "messages[1].role",
            "unknown_role",
        ),
        ([{"role": "User", "content": "a"}], "messages[0].role", "unknown_role"),
    ],
)
def test_conversation_bad_rows(value, field, reason) -> None:
    bad = chat_template.conversation(value, entry())
    assert isinstance(bad, BadRow)
    assert (bad.field, bad.reason) == (field, reason)
    assert bad.detail


def test_check_message_keys_from_features() -> None:
    ds = datasets.Dataset.from_list([{"conversations": [{"from": "human", "value": "Hi"}]}])
    e = entry(field_messages="conversations")
    with pytest.raises(DataError) as err:
        chat_template.check(e, ds.features, "data.datasets[0]")
    msg = str(err.value)
    assert "message key 'role'" in msg and "message_field_role" in msg and "['from', 'value']" in msg
    assert "in the messages of column 'conversations'" in msg
    e = entry(field_messages="conversations", message_field_role="from")
    with pytest.raises(DataError, match="message key 'content'"):
        chat_template.check(e, ds.features, "data.datasets[0]")
    e = entry(field_messages="conversations", message_field_role="from", message_field_content="value")
    chat_template.check(e, ds.features, "data.datasets[0]")
