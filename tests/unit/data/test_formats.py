"""Row formats: column checks, the Alpaca prompt, conversation normalization, bad-row detection."""

from __future__ import annotations

import doctest

import datasets
import pytest

from finetune.data import formats
from finetune.data.formats import BadRow
from finetune.errors import DataError
from finetune.recipe import DatasetEntry


def entry(**kw) -> DatasetEntry:
    kw.setdefault("path", "data/x.jsonl")
    return DatasetEntry(**kw)


def test_doctests() -> None:
    assert doctest.testmod(formats).failed == 0


# ------------------------------------------------------------------------------------------ alpaca


def test_alpaca_prompt_with_and_without_input() -> None:
    with_input = formats.alpaca_prompt("Add the numbers.", "2 and 3")
    assert with_input == (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n### Response:\n"
    )
    for empty in ("", None):
        assert formats.alpaca_prompt("Say hi.", empty) == (
            "Below is an instruction that describes a task. "
            "Write a response that appropriately completes the request.\n\n"
            "### Instruction:\nSay hi.\n\n### Response:\n"
        )


def test_alpaca_pairs_and_bad_rows() -> None:
    e = entry(type="alpaca")
    batch = {
        "instruction": ["Do A.", None, "Do C.", 5],
        "input": ["ctx", "x", None, ""],
        "output": ["done", "y", None, "z"],
    }
    out = formats.prompt_completion_pairs(batch, e)
    assert out[0] == (formats.alpaca_prompt("Do A.", "ctx"), "done")
    assert out[1] == BadRow("instruction", "missing_field", "'instruction' is missing or null")
    assert isinstance(out[2], BadRow) and (out[2].field, out[2].reason) == ("output", "missing_field")
    assert isinstance(out[3], BadRow) and (out[3].field, out[3].reason) == ("instruction", "wrong_type")


def test_alpaca_without_input_column() -> None:
    e = entry(type="alpaca")
    out = formats.prompt_completion_pairs({"instruction": ["Do A."], "output": ["done"]}, e)
    assert out == [(formats.alpaca_prompt("Do A.", None), "done")]


def test_input_output_pairs_with_mapping() -> None:
    e = entry(type="input_output", field_prompt="question", field_completion="answer")
    out = formats.prompt_completion_pairs({"question": ["Q?", "Q2", None], "answer": ["A", ["x"], "A3"]}, e)
    assert out[0] == ("Q?", "A")
    assert isinstance(out[1], BadRow) and (out[1].field, out[1].reason) == ("answer", "wrong_type")
    assert isinstance(out[2], BadRow) and (out[2].field, out[2].reason) == ("question", "missing_field")


def test_completion_texts() -> None:
    e = entry(type="completion", field_text="body")
    out = formats.completion_texts({"body": ["hello", None, 3]}, e)
    assert out[0] == "hello"
    assert [(b.field, b.reason) for b in out[1:]] == [("body", "missing_field"), ("body", "wrong_type")]


# -------------------------------------------------------------------------------------------- chat


def test_conversation_role_map_sharegpt() -> None:
    e = entry(
        type="chat_template",
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
    assert formats.conversations(rows, e) == [
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"weight": 1, "role": "assistant", "content": "Hello"},
        ]
    ]


def test_unknown_roles_and_role_map_targets() -> None:
    msgs = [{"role": "ipython", "content": "42"}, {"role": "assistant", "content": "ok"}]
    bad = formats.conversation(msgs, entry(type="chat_template"))
    assert isinstance(bad, BadRow) and bad.reason == "unknown_role" and bad.field == "messages[0].role"
    assert (
        "'ipython'" in bad.detail and "{ipython: ipython}" in bad.detail and "{ipython: user}" in bad.detail
    )
    # A role_map target is a known role: mapping a role to itself declares one the template has.
    ok = formats.conversation(msgs, entry(type="chat_template", role_map={"ipython": "ipython"}))
    assert [m["role"] for m in ok] == ["ipython", "assistant"]
    mapped = formats.conversation(
        [{"role": "human", "content": "a"}], entry(type="chat_template", role_map={"human": "humano"})
    )
    assert mapped == [{"role": "humano", "content": "a"}]  # any role_map target is known, by design


def test_empty_completion_is_a_counted_drop_not_a_bad_row() -> None:
    e = entry(type="alpaca")
    out = formats.prompt_completion_pairs({"instruction": ["A", "B", "C"], "output": ["done", "", " \n"]}, e)
    assert out[0] == (formats.alpaca_prompt("A", None), "done")
    for bad in out[1:]:
        assert isinstance(bad, BadRow) and not bad.malformed
        assert (bad.field, bad.reason, bad.drop_key) == ("output", "empty_completion", "empty_completion")
    assert "is empty" in out[1].detail and "only whitespace" in out[2].detail
    e = entry(type="input_output", field_prompt="q", field_completion="a")
    [bad] = formats.prompt_completion_pairs({"q": ["Q?"], "a": [""]}, e)
    assert isinstance(bad, BadRow) and (bad.field, bad.reason) == ("a", "empty_completion")
    # With train_on_inputs the prompt is trained: the row is kept.
    e = entry(type="input_output", field_prompt="q", field_completion="a", train_on_inputs=True)
    assert formats.prompt_completion_pairs({"q": ["Q?"], "a": [""]}, e) == [("Q?", "")]


def test_pair_conversations_for_the_chat_template() -> None:
    e = entry(type="alpaca", apply_chat_template=True)
    batch = {"instruction": ["Add.", "Say hi."], "input": ["2 and 3", None], "output": ["5", "hi"]}
    assert formats.pair_conversations(batch, e) == [
        [{"role": "user", "content": "Add.\n\n2 and 3"}, {"role": "assistant", "content": "5"}],
        [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}],
    ]
    e = entry(
        type="input_output", field_prompt="question", field_completion="answer", apply_chat_template=True
    )
    out = formats.pair_conversations({"question": ["Q?", None, "Q3"], "answer": ["A", "x", ""]}, e)
    assert out[0] == [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A"}]
    assert (out[1].field, out[1].reason) == ("question", "missing_field")
    assert (out[2].field, out[2].reason) == ("answer", "empty_completion")


def test_conversation_keeps_unmapped_roles_and_drops_null_keys() -> None:
    e = entry(type="chat_template")
    msgs = [
        {"role": "tool", "content": "42", "name": None},
        {"role": "assistant", "content": "ok", "name": "x"},
    ]
    assert formats.conversation(msgs, e) == [
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
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content", "wrong_type"),
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
    bad = formats.conversation(value, entry(type="chat_template"))
    assert isinstance(bad, BadRow)
    assert (bad.field, bad.reason) == (field, reason)
    assert bad.detail


# ----------------------------------------------------------------------------------------- columns


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
    with pytest.raises(DataError, match="'text'"):
        formats.check_columns(entry(type="completion"), ["content"])
    with pytest.raises(DataError, match="'input_ids'"):
        formats.check_columns(entry(type="tokenized"), ["ids", "labels"])
    # An explicitly mapped input column must exist: no silent fallback to "no input".
    with pytest.raises(DataError, match="'context'"):
        formats.check_columns(entry(type="alpaca", field_input="context"), ["instruction", "output"])


def test_check_message_keys_from_features() -> None:
    ds = datasets.Dataset.from_list([{"conversations": [{"from": "human", "value": "Hi"}]}])
    e = entry(type="chat_template", field_messages="conversations")
    with pytest.raises(DataError) as err:
        formats.check_columns(e, ds.column_names, features=ds.features)
    msg = str(err.value)
    assert "message key 'role'" in msg and "message_field_role" in msg and "['from', 'value']" in msg
    e = entry(type="chat_template", field_messages="conversations", message_field_role="from")
    with pytest.raises(DataError, match="message key 'content'"):
        formats.check_columns(e, ds.column_names, features=ds.features)
    e = entry(
        type="chat_template",
        field_messages="conversations",
        message_field_role="from",
        message_field_content="value",
    )
    formats.check_columns(e, ds.column_names, features=ds.features)
