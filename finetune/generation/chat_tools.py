"""Chat tool calls in the chat template's own format: the tool schema from the function, the calls
parsed from an assistant turn, and the tokens that follow it (the tool messages, rendered by the
template, and the next assistant turn's start).

How a call is read from the assistant's text (`parse_calls`), in this order:
* the tokenizer's ``response_template`` (transformers' response parsing, `tokenizer.parse_response`),
  when it has one;
* else the template's markers: Qwen2.5 / Qwen3 / Hermes ``<tool_call>{json}</tool_call>`` (one or
  more), Mistral ``[TOOL_CALLS][{json}, ...]``, Llama 3.1 a JSON object ``{"name", "parameters"}`` as
  the whole turn (after an optional ``<|python_tag|>``). Which one a template uses is read from its text
  (`call_format`).

What follows a call turn is rendered, not written by hand (`continuation_text`): the template renders
the conversation with the call turn (A), and with the tool messages and the generation prompt after it
(B); what B adds to A, plus whatever A has after the call turn's end-of-turn token (Qwen's newline), is
inserted after the model's own tokens. The model's tokens are never re-rendered, so its call is kept
as it sampled it.

>>> parse_calls('Let me see.\\n<tool_call>\\n{"name": "add", "arguments": {"a": 1}}\\n</tool_call>', "hermes")
('Let me see.', [{'type': 'function', 'function': {'name': 'add', 'arguments': {'a': 1}}}], None)
>>> parse_calls('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}, "id": "abcdefghi"}]', "mistral")[1]
[{'type': 'function', 'function': {'name': 'add', 'arguments': {'a': 1}}, 'id': 'abcdefghi'}]
>>> parse_calls('{"name": "add", "parameters": {"a": 1}}', "llama3")[1][0]["function"]
{'name': 'add', 'arguments': {'a': 1}}
>>> parse_calls("It is 3.", "hermes")
('It is 3.', None, None)
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from finetune.errors import FinetuneError

FORMATS = ("response_template", "hermes", "mistral", "llama3")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def tool_schema(fn: Callable, label: str) -> dict[str, Any]:
    """The function's JSON schema for the chat template (transformers' get_json_schema: its type hints
    and Google-style docstring); a FinetuneError naming the tool when they are missing."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as exc:
        raise FinetuneError(
            f"{label}: a chat tool's schema comes from its signature and docstring (transformers' "
            f"get_json_schema): {exc}. Give every argument a type hint and an `Args:` line in the docstring"
        ) from None


def call_format(tokenizer, label: str) -> str:
    """How the tokenizer's chat template writes tool calls (one of FORMATS); an error when the template
    takes no tools or uses a format finetune does not know."""
    if getattr(tokenizer, "response_template", None) is not None:
        return "response_template"
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    if "tools" not in template:
        raise FinetuneError(
            f"{label}: a chat tool (no trigger) needs a chat template that renders tools, and this tokenizer's has "
            "no `tools` variable; set model.chat_template to the model family's tool template, or give the tool "
            "a trigger (an inline call)"
        )
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if '"parameters"' in template and "ipython" in template:
        return "llama3"
    raise FinetuneError(
        f"{label}: the chat template renders tools, but in none of the call formats finetune reads "
        '(<tool_call> JSON as Qwen, [TOOL_CALLS] as Mistral, a {"name", "parameters"} turn as Llama 3.1) and '
        "the tokenizer has no response_template for transformers' response parsing; give it one, or use an "
        "inline trigger"
    )


def _call(value: Any, *, arguments_key: str = "arguments") -> dict[str, Any] | None:
    """A parsed call in the HF shape, or None when it is not one (no name, arguments not a mapping)."""
    if not isinstance(value, dict):
        return None
    function = value.get("function", value)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return None
    arguments = function.get(arguments_key, function.get("arguments", function.get("parameters", {})))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    call: dict[str, Any] = {
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }
    if value.get("id") is not None:
        call["id"] = str(value["id"])
    return call


def parse_calls(
    text: str, fmt: str, *, tokenizer=None, prefix: str = "", tools: list | None = None
) -> tuple[str, list[dict[str, Any]] | None, str | None]:
    """(the turn's text without its calls, its calls or None, a problem): `text` is the assistant turn
    as generated (special tokens kept, its end-of-turn token removed). A problem (the call markers are
    there but what they hold is not a call) ends the conversation there, counted as a tool error."""
    if fmt == "response_template":
        try:
            message = tokenizer.parse_response(text, prefix=prefix, tools=tools)
        except Exception as exc:
            return text, None, f"the response parser failed: {type(exc).__name__}: {exc}"
        raw = message.get("tool_calls") or None
        if raw is None:
            return str(message.get("content") or text), None, None
        calls = [_call(c) for c in raw]
        if any(c is None for c in calls):
            return text, None, f"not a tool call: {raw!r:.200}"
        return str(message.get("content") or ""), calls, None
    if fmt == "hermes":
        found = _HERMES.findall(text)
        if not found:
            return text, None, None
        calls = []
        for body in found:
            try:
                call = _call(json.loads(body))
            except json.JSONDecodeError as exc:
                return text, None, f"the tool call is not valid JSON ({exc.msg}): {body[:120]!r}"
            if call is None:
                return text, None, f"not a tool call (a name and arguments): {body[:120]!r}"
            calls.append(call)
        return text[: text.index("<tool_call>")].strip(), calls, None
    if fmt == "mistral":
        if "[TOOL_CALLS]" not in text:
            return text, None, None
        content, _, body = text.partition("[TOOL_CALLS]")
        try:
            raw = json.loads(body.strip())
        except json.JSONDecodeError as exc:
            return text, None, f"the tool calls are not valid JSON ({exc.msg}): {body[:120]!r}"
        calls = [_call(c) for c in (raw if isinstance(raw, list) else [raw])]
        if not calls or any(c is None for c in calls):
            return text, None, f"not a list of tool calls: {body[:120]!r}"
        return content.strip(), calls, None
    if fmt == "llama3":
        body = text.replace("<|python_tag|>", "").strip()
        if not (body.startswith("{") and '"name"' in body):
            return text, None, None
        try:
            call = _call(json.loads(body), arguments_key="parameters")
        except json.JSONDecodeError as exc:
            return text, None, f"the tool call is not valid JSON ({exc.msg}): {body[:120]!r}"
        if call is None:
            return text, None, f"not a tool call (a name and parameters): {body[:120]!r}"
        return "", [call], None
    raise ValueError(f"unknown tool-call format {fmt!r}")


def call_id(index: int) -> str:
    """A call's id where the model wrote none: 9 alphanumeric characters, as Mistral's template wants.

    >>> call_id(3)
    'call00003'
    """
    return f"call{index:05d}"


SENTINEL = "FINETUNE_ANSWER_0c9f"  # stands for the first answer's content while its place is found


def continuation_text(
    tokenizer,
    messages: list[dict[str, Any]],
    answer: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None,
    stop_texts: list[str],
) -> str:
    """The text that follows the model's turn (the last of `messages`, ended by one of `stop_texts`, its
    end-of-turn tokens) when `answer` (the tool or user messages answering it) follows, up to the next
    assistant turn's start (see the module docstring).

    The template renders the whole conversation with the generation prompt; the inserted text starts
    right after the last end-of-turn token before the first answer's content (found by rendering it once
    with a sentinel in its place). Only that end is read: templates that render earlier turns
    differently once a later one follows (Qwen3 drops an empty think block from past turns) still work,
    since the model's own tokens are kept as it sampled them."""

    def render(answers: list[dict[str, Any]]) -> str:
        return tokenizer.apply_chat_template(
            [*messages, *answers], tools=tools, tokenize=False, add_generation_prompt=True
        )

    marked = render([{**answer[0], "content": SENTINEL}, *answer[1:]])
    where = marked.find(SENTINEL)
    ends = [
        marked.rfind(stop, 0, where) + len(stop) for stop in stop_texts if marked.rfind(stop, 0, where) >= 0
    ]
    if where < 0 or not ends:
        raise FinetuneError(
            "the chat template renders a tool result where finetune cannot place it after the model's turn "
            f"(no end-of-turn token {stop_texts} before it); use an inline trigger with this template"
        )
    return render(answer)[max(ends) :]
