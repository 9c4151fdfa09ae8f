"""The tool calls of chat messages normalized (finetune.data.formats.chat)."""

from __future__ import annotations

from finetune.data.formats.chat import conversation, empty_turns, normalized_calls, tool_definitions
from finetune.data.formats.rows import BadRow


def test_openai_hf_and_flat_calls_normalize_alike() -> None:
    want = [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}, "id": "c1"}]
    openai = [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]
    hf = [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]
    flat = [{"id": "c1", "name": "add", "arguments": '{"a": 1}'}]
    assert (
        normalized_calls(openai, "m[1]")
        == normalized_calls(hf, "m[1]")
        == normalized_calls(flat, "m[1]")
        == want
    )
    no_id = normalized_calls([{"function": {"name": "add", "arguments": {}}}], "m[1]")
    assert no_id == [{"type": "function", "function": {"name": "add", "arguments": {}}}]


def test_bad_calls_name_their_field() -> None:
    cases = [
        ("not a list", "m[1].tool_calls", "wrong_type"),
        (["x"], "m[1].tool_calls[0]", "wrong_type"),
        ([{"function": {"name": "f"}}], "m[1].tool_calls[0].function.arguments", "missing_field"),
        ([{"function": {"name": " ", "arguments": {}}}], "m[1].tool_calls[0].function.name", "missing_field"),
        (
            [{"function": {"name": "f", "arguments": "3"}}],
            "m[1].tool_calls[0].function.arguments",
            "bad_tool_call",
        ),
        ([{"name": "f", "arguments": "{x"}], "m[1].tool_calls[0].arguments", "bad_tool_call"),
    ]
    for value, field, reason in cases:
        bad = normalized_calls(value, "m[1]")
        assert isinstance(bad, BadRow) and (bad.field, bad.reason) == (field, reason), value


def test_tools_column_values() -> None:
    schema = {"type": "function", "function": {"name": "f"}}
    assert tool_definitions(None, "tools") is None
    assert tool_definitions("", "tools") is None and tool_definitions([], "tools") is None
    assert tool_definitions([schema], "tools") == tool_definitions(
        '[{"type": "function", "function": {"name": "f"}}]', "tools"
    )
    assert tool_definitions("{", "tools").reason == "bad_tools"
    assert tool_definitions([1], "tools").field == "tools[0]"


def test_conversation_with_calls() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "ok", "tool_call_id": "c1"},
        {"role": "assistant", "content": "done", "tool_calls": []},  # an empty list is no call
    ]
    conv = conversation(msgs, "messages")
    assert conv[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}, "id": "c1"}],
    }
    assert conv[3] == {"role": "assistant", "content": "done"}
    # A turn with calls and no text is not an empty turn: the row trains its calls.
    assert empty_turns(conv[:2], ["assistant"], "messages") is None
    # Without calls, a null content is still a missing field.
    assert conversation([{"role": "assistant", "content": None}], "messages").reason == "missing_field"


def test_arguments_nested_too_deeply_are_bad_calls() -> None:
    """A mapping (the HF form) nested 100,000 deep is a bad call naming its field, walked without
    recursion; 100 levels pass."""

    def nested(depth: int) -> dict:
        value: dict = {}
        for _ in range(depth - 1):
            value = {"a": value}
        return value

    bad = normalized_calls([{"function": {"name": "f", "arguments": nested(100_000)}}], "m[1]")
    assert isinstance(bad, BadRow) and (bad.field, bad.reason) == (
        "m[1].tool_calls[0].function.arguments",
        "bad_tool_call",
    )
    assert "more than 100 levels" in bad.detail
    ok = normalized_calls([{"function": {"name": "f", "arguments": nested(100)}}], "m[1]")
    assert not isinstance(ok, BadRow)
    assert tool_definitions([{"type": "function", "function": nested(200)}], "tools").reason == "bad_tools"
