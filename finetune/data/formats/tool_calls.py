"""Tool calling in chats: an assistant turn's ``tool_calls``, the ``tool`` turns that answer them, and a
row's tool definitions, normalized to what Hugging Face chat templates expect.

Rows come in the OpenAI form (``function.arguments`` a JSON string, ``content: null``) or the HF form
(``arguments`` a mapping); templates differ in what they read (Qwen writes ``arguments | tojson``,
Llama 3.1 ``tool_call.function``, Mistral the call's ``id``), so every call becomes
``{"type": "function", "function": {"name", "arguments": {...}}, "id"?}`` (transformers' documented
shape, see its chat templating docs on tool use). A call may also be written flat,
``{"name", "arguments"}``, as some datasets do.

>>> calls([{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}], "m[1]")
[{'type': 'function', 'function': {'name': 'add', 'arguments': {'a': 1}}, 'id': 'c1'}]
>>> calls([{"function": {"name": "add", "arguments": "{a: 1}"}}], "m[1]").field
'm[1].tool_calls[0].function.arguments'
>>> tools('[{"type": "function", "function": {"name": "add"}}]', "tools")
[{'type': 'function', 'function': {'name': 'add'}}]
"""

from __future__ import annotations

import json
from typing import Any

from finetune.data.formats.rows import MISSING_FIELD, WRONG_TYPE, BadRow

# Bad-row reasons of tool calls (the manifest counts them as "bad_row:<reason>").
BAD_TOOL_CALL = "bad_tool_call"
ORPHAN_TOOL_RESULT = "orphan_tool_result"
BAD_TOOLS = "bad_tools"


def calls(value: Any, where: str) -> list[dict[str, Any]] | BadRow:
    """A message's ``tool_calls`` in the HF shape, or the bad row naming the call and field at fault
    (`where` is the message's path, e.g. ``messages[1]``)."""
    if not isinstance(value, list):
        return BadRow(
            f"{where}.tool_calls", WRONG_TYPE, f"tool_calls should be a list, got {type(value).__name__}"
        )
    out = []
    for k, call in enumerate(value):
        at = f"{where}.tool_calls[{k}]"
        if not isinstance(call, dict):
            return BadRow(at, WRONG_TYPE, f"tool call {k} should be a mapping, got {type(call).__name__}")
        function = call.get("function", call)  # the flat form {"name", "arguments"} is its own function
        if not isinstance(function, dict):
            return BadRow(f"{at}.function", WRONG_TYPE, f"{at}.function should be a mapping")
        fn_at = f"{at}.function" if "function" in call else at
        name = function.get("name")
        if not isinstance(name, str) or not name.strip():
            return BadRow(
                f"{fn_at}.name", MISSING_FIELD, f"tool call {k} has no function name ({fn_at}.name)"
            )
        arguments = _arguments(function.get("arguments"), f"{fn_at}.arguments")
        if isinstance(arguments, BadRow):
            return arguments
        normalized: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
        if call.get("id") is not None:
            normalized["id"] = call["id"]
        out.append(normalized)
    return out


def _arguments(value: Any, field: str) -> dict[str, Any] | BadRow:
    """A call's arguments as a mapping: the OpenAI form's JSON string parsed, the HF form's kept."""
    if value is None:
        return BadRow(field, MISSING_FIELD, f"{field!r} is missing: write the call's arguments, {{}} if none")
    if isinstance(value, str):
        value = _parsed(value, field, BAD_TOOL_CALL)
        if isinstance(value, BadRow):
            return value
    if not isinstance(value, dict):
        return BadRow(
            field, BAD_TOOL_CALL, f"{field!r} should be a JSON object of named arguments, got {value!r:.80}"
        )
    return value


def _parsed(text: str, field: str, reason: str) -> Any:
    """`text` parsed as JSON, or the bad row (under `reason`) saying where the parse failed."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return BadRow(field, reason, f"{field!r} is not valid JSON ({e.msg} at char {e.pos}): {text[:80]!r}")


def orphan_result(turns: list[dict[str, Any]], field: str) -> BadRow | None:
    """The bad row of a ``tool`` turn that no assistant tool call comes before (its result answers
    nothing the model asked), else None. Only in rows that use ``tool_calls``: data that writes its
    calls as the assistant's text (ShareGPT ``function_call`` / ``observation`` turns) has no calls to
    pair its results with.

    >>> turns = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "3"}]
    >>> orphan_result([*turns, {"role": "assistant", "content": "", "tool_calls": [{}]}], "messages").field
    'messages[1]'
    >>> orphan_result(turns, "messages") is None
    True
    """
    if not any(has_calls(turn) for turn in turns):
        return None
    called = False
    for j, turn in enumerate(turns):
        if turn["role"] == "tool" and not called:
            return BadRow(
                f"{field}[{j}]",
                ORPHAN_TOOL_RESULT,
                f"message {j} is a tool result, but no assistant message before it has tool_calls",
            )
        if turn["role"] != "tool":  # results answer the calls of the turn right before them
            called = has_calls(turn)
    return None


def tools(value: Any, field: str) -> list[dict[str, Any]] | BadRow | None:
    """A row's tool definitions (a list of JSON schemas, or a JSON string of one), None when the row
    has none (null or an empty list), or the bad row saying why they can't be used."""
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            return None
        value = _parsed(value, field, BAD_TOOLS)
        if isinstance(value, BadRow):
            return value
    if not isinstance(value, list):
        return BadRow(
            field, BAD_TOOLS, f"{field!r} should be a list of function schemas, got {type(value).__name__}"
        )
    for k, schema in enumerate(value):
        if not isinstance(schema, dict):
            return BadRow(f"{field}[{k}]", BAD_TOOLS, f"tool {k} should be a JSON object (a function schema)")
    return value or None


def has_calls(message: dict[str, Any]) -> bool:
    """Whether a normalized message carries tool calls."""
    return bool(message.get("tool_calls"))


def called_names(message: dict[str, Any]) -> list[str]:
    """The function names a normalized message calls."""
    return [c["function"]["name"] for c in message.get("tool_calls") or []]
