"""Chats: the roles a message may have, one row's messages normalized (tool calls included), and the
character spans of a rendered conversation that are trained.

Shared by the formats that render rows with the chat template (finetune/data/formats/: chat_template,
alpaca and input_output with apply_chat_template, preference and kto): pure functions of the
messages and of a `render` function (the tokenizer's apply_chat_template, see encode.py).

>>> keys = MessageKeys("from", "value", {"human": "user", "gpt": "assistant"})
>>> conversation([{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}], "conversations", keys)
[{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello'}]
>>> conversation([{"from": "wizard", "value": "Hi"}], "conversations", keys).reason
'unknown_role'

Tool calls: an assistant turn's ``tool_calls``, the ``tool`` turns that answer them, and a
row's tool definitions, normalized to what Hugging Face chat templates expect.

Rows come in the OpenAI form (``function.arguments`` a JSON string, ``content: null``) or the HF form
(``arguments`` a mapping); templates differ in what they read (Qwen writes ``arguments | tojson``,
Llama 3.1 ``tool_call.function``, Mistral the call's ``id``), so every call becomes
``{"type": "function", "function": {"name", "arguments": {...}}, "id"?}`` (transformers' documented
shape, see its chat templating docs on tool use). A call may also be written flat,
``{"name", "arguments"}``, as some datasets do.

>>> normalized_calls([{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}], "m[1]")
[{'type': 'function', 'function': {'name': 'add', 'arguments': {'a': 1}}, 'id': 'c1'}]
>>> normalized_calls([{"function": {"name": "add", "arguments": "{a: 1}"}}], "m[1]").field
'm[1].tool_calls[0].function.arguments'
>>> tool_definitions('[{"type": "function", "function": {"name": "add"}}]', "tools")
[{'type': 'function', 'function': {'name': 'add'}}]
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from finetune.data.formats import images
from finetune.data.formats.rows import (
    EMPTY_COMPLETION,
    EMPTY_CONVERSATION,
    MISSING_FIELD,
    ROLE_REJECTED,
    TEMPLATE_MISMATCH,
    TEMPLATE_WITHOUT_TOOLS,
    UNKNOWN_ROLE,
    WRONG_TYPE,
    BadRow,
    text,
)
from finetune.errors import DataError

DEFAULT_ROLES = ("system", "user", "assistant", "tool")
"""The roles chat templates know. Others are known only as targets of the entry's ``role_map``
(map a role to itself, ``{ipython: ipython}``, to declare one the template supports)."""


# Bad-row reasons of tool calls (the manifest counts them as "bad_row:<reason>").
BAD_TOOL_CALL = "bad_tool_call"
ORPHAN_TOOL_RESULT = "orphan_tool_result"
BAD_TOOLS = "bad_tools"
MAX_JSON_DEPTH = 100
"""How deeply a call's arguments or a tool definition may nest. The template renders them with
`tojson`, one Python call per level: a few hundred levels reach Python's recursion limit while the
template renders (and 100,000 while the JSON string is parsed). Real arguments and schemas nest a few
levels; deeper ones are bad rows that say so, counted as data.on_bad_row says."""


# ----------------------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class MessageKeys:
    """How an entry's messages spell a role and a content, and how its roles are renamed."""

    role: str = "role"
    content: str = "content"
    role_map: Mapping[str, str] = dataclasses.field(default_factory=dict)


def message_keys(entry: Any) -> MessageKeys:
    """The MessageKeys of an entry whose format reads lists of messages (chat_template, preference, kto)."""
    return MessageKeys(entry.message_field_role, entry.message_field_content, entry.role_map)


def known_roles(role_map: Mapping[str, str]) -> set[str]:
    """The roles messages may have after ``role_map``: the defaults and the map's targets.

    >>> sorted(known_roles({"human": "user", "ipython": "ipython"}))
    ['assistant', 'ipython', 'system', 'tool', 'user']
    """
    return {*DEFAULT_ROLES, *role_map.values()}


def conversation(
    value: Any, field: str, keys: MessageKeys = MessageKeys(), known: set[str] | None = None
) -> list[dict[str, Any]] | BadRow:
    """One row's messages as ``[{"role", "content", ...}]`` with ``role_map`` applied, or the reason
    it can't be used (``field`` names the column in problems).

    Other keys of a message (e.g. ``tool_calls``) are kept for the template; nulls are dropped. A
    content that is a list of parts becomes its text with a ``images.SENTINEL`` per image, the image
    references in the message's ``images`` (finetune.data.formats.images). A
    role that is not in ``known`` (default: `known_roles`) after ``role_map`` is a bad row:
    templates render any role string, so a typo or an unmapped ShareGPT role would otherwise train
    silently in the wrong shape.
    """
    known = known_roles(keys.role_map) if known is None else known
    if value is None:
        return BadRow(field, MISSING_FIELD, f"{field!r} is missing or null")
    if not isinstance(value, list):
        return BadRow(
            field, WRONG_TYPE, f"{field!r} should be a list of messages, got {type(value).__name__}"
        )
    if not value:
        return BadRow(field, EMPTY_CONVERSATION, f"{field!r} is an empty list of messages")
    turns = []
    for j, msg in enumerate(value):
        where = f"{field}[{j}]"
        if not isinstance(msg, dict):
            return BadRow(where, WRONG_TYPE, f"message {j} should be a mapping, got {type(msg).__name__}")
        role = text(msg.get(keys.role), f"{where}.{keys.role}")
        if isinstance(role, BadRow):
            return role
        extra = {k: v for k, v in msg.items() if k not in (keys.role, keys.content) and v is not None}
        if extra.get("tool_calls") == []:
            del extra["tool_calls"]  # no calls: a plain turn (templates test the key, not its length)
        if "tool_calls" in extra:
            extra["tool_calls"] = normalized_calls(extra["tool_calls"], where)
            if isinstance(extra["tool_calls"], BadRow):
                return extra["tool_calls"]
        # A turn that only calls tools has content null (OpenAI) or "": templates expect a string.
        raw = msg.get(keys.content)
        if isinstance(raw, list):  # parts: text, and images (a SENTINEL each, their references kept)
            content = images.parts_text(raw, f"{where}.{keys.content}")
            if isinstance(content, BadRow):
                return content
            content, refs = content
            extra.pop("images", None)
            if refs:
                extra["images"] = refs
        else:
            content = "" if raw is None and "tool_calls" in extra else text(raw, f"{where}.{keys.content}")
        if isinstance(content, BadRow):
            return content
        role = keys.role_map.get(role, role)
        if role not in known:  # role_map targets are known: only a role the map left alone gets here
            return BadRow(f"{where}.{keys.role}", UNKNOWN_ROLE, _unknown_role_detail(j, role, known))
        turns.append({**extra, "role": role, "content": content})
    return orphan_result(turns, field) or turns


def _unknown_role_detail(j: int, role: str, known: set[str]) -> str:
    return (
        f"message {j} has role {role!r}, which is not a chat role ({', '.join(sorted(known))}); map it with "
        f"role_map, e.g. {{{role}: user}}, or, if the chat template has this role, to itself: {{{role}: {role}}}"
    )


def pair_turns(pairs: list[tuple[str, str] | BadRow]) -> list[list[dict[str, str]] | BadRow]:
    """Each (prompt, completion) pair as a user turn and an assistant turn, for the chat template.

    >>> pair_turns([("2+2?", "4")])
    [[{'role': 'user', 'content': '2+2?'}, {'role': 'assistant', 'content': '4'}]]
    """
    return [
        pair
        if isinstance(pair, BadRow)
        else [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
        for pair in pairs
    ]


def check_roles_to_train(roles_to_train: list[str], role_map: Mapping[str, str], entry_label: str) -> None:
    """Raise a DataError when a role to train is none that messages can have (nothing would train)."""
    known = known_roles(role_map)
    unknown = [r for r in roles_to_train if r not in known]
    if unknown:
        mapped = {k: v for k, v in role_map.items() if k in unknown}
        hint = f" role_map renames {mapped}: name the roles it maps to." if mapped else ""
        raise DataError(
            f"{entry_label}.roles_to_train: {unknown} not among the roles messages have after role_map "
            f"({', '.join(sorted(known))}), so nothing of theirs would be trained.{hint}"
        )


def empty_turns(conv: list[dict[str, Any]], roles_to_train: list[str], field: str) -> BadRow | None:
    """A drop when every turn to train is empty or whitespace (the row would train only end tokens)."""
    trained = [m["content"] for m in conv if m["role"] in roles_to_train and not has_calls(m)]
    calls = any(has_calls(m) for m in conv if m["role"] in roles_to_train)
    if trained and not calls and not any(c.strip() for c in trained):
        roles = "/".join(roles_to_train)
        detail = f"every {roles} turn is empty or whitespace: the row would train nothing"
        return BadRow(field, EMPTY_COMPLETION, detail, malformed=False)
    return None


# --------------------------------------------------------------------------------------- tool calls


def normalized_calls(value: Any, where: str) -> list[dict[str, Any]] | BadRow:
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
    return _too_deep(value, field, BAD_TOOL_CALL) or value


def _parsed(text: str, field: str, reason: str) -> Any:
    """`text` parsed as JSON, or the bad row (under `reason`) saying where the parse failed."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return BadRow(field, reason, f"{field!r} is not valid JSON ({e.msg} at char {e.pos}): {text[:80]!r}")
    except RecursionError:  # json's parser recurses once per level of nesting
        return BadRow(
            field,
            reason,
            f"{field!r} nests too deeply to parse (more than {MAX_JSON_DEPTH} levels are refused)",
        )


def _too_deep(value: Any, field: str, reason: str) -> BadRow | None:
    """The bad row of a JSON value nested more than MAX_JSON_DEPTH levels, else None (walked with a
    stack, not recursion, for any depth).

    >>> _too_deep({"a": [[1]]}, "f", "bad") is None, _too_deep([[[]]] * 2, "f", "bad") is None
    (True, True)
    """
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return BadRow(
                field, reason, f"{field!r} nests more than {MAX_JSON_DEPTH} levels deep: the chat template "
                "could not render it; flatten it"
            )  # fmt: skip
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return None


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


def tool_definitions(value: Any, field: str) -> list[dict[str, Any]] | BadRow | None:
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
    return _too_deep(value, field, BAD_TOOLS) or value or None


def has_calls(message: dict[str, Any]) -> bool:
    """Whether a normalized message carries tool calls."""
    return bool(message.get("tool_calls"))


def called_names(message: dict[str, Any]) -> list[str]:
    """The function names a normalized message calls."""
    return [c["function"]["name"] for c in message.get("tool_calls") or []]


# ------------------------------------------------------------------------------------- chat masking


class ChatTemplateError(Exception):
    """The template rejected a conversation (reason role_rejected) or rendered it in a way the
    masking can't follow (reason template_mismatch)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


# Private-use characters: no tokenizer or template produces them, so a marker can't collide.
_MARK = "\ue000{}\ue001"
_MARK_RE = re.compile("\ue000(\\d+)\ue001")


def chat_spans(
    messages: list[dict[str, Any]],
    render: Callable[[list[dict[str, Any]]], str],
    *,
    roles_to_train: list[str],
    train_on_eos: str = "turn",
    trained: list[int] | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """Render ``messages`` and return (text, the sorted character spans to train).

    The trained turns are the messages whose role is in ``roles_to_train``, or the indices in
    ``trained`` when given (a preference completion's turns, not the prompt's).

    How the spans are found, for any template (ChatML, Llama-2's folded system prompt, BOS in the
    template, ...), without assumptions about its markup:

    1. Content: render the conversation once more with each message's content replaced by a
       unique marker. The text between markers is the template's own markup, so walking both
       renderings side by side gives where each content lies in the real text (the content may be
       stripped by the template). When the walk fails (a template that reacts to the content), a
       rendering with a single marker per message gives its span exactly: the text before the
       marker is the same, and so is the text after the content.
    2. End of turn: a message's turn ends where the rendering of ``messages[:i+1]`` stops being a
       prefix of the full text (the last message's turn ends at the end). What lies between the
       content and that point, without surrounding whitespace, is the end-of-turn text (e.g.
       ``<|im_end|>`` for ChatML, ``</s>`` for Llama-2); it is trained per ``train_on_eos``:
       turn (every trained turn), last (the last trained turn), all (every turn), none.

    The caller trains every token that overlaps a span: a token that merges markup with content
    (Llama's ``▁It`` after ``[/INST] ``) is trained, a markup-only one (a lone ``▁`` before a
    digit, ChatML's ``\n`` after the role) is not.
    """
    full = render_messages(render, messages)
    if trained is None:
        trained = [i for i, m in enumerate(messages) if m["role"] in roles_to_train]
    eos_turns = {
        "turn": trained,
        "last": trained[-1:],
        "all": list(range(len(messages))),
        "none": [],
    }[train_on_eos]
    if not trained and not eos_turns:
        return full, []
    content = _content_spans(messages, full, render, needed=sorted({*trained, *eos_turns}))
    spans = [content[i] for i in trained if content[i] and content[i][1] > content[i][0]]
    calls = [i for i in trained if has_calls(messages[i])]
    for i in eos_turns:
        if content[i] is None or i in calls:
            continue  # a turn with tool calls trains its end with its calls (below)
        start = content[i][1]
        span = _stripped(full, start, _turn_end(messages, i, full, render))
        if span:
            spans.append(span)
    for i in calls:
        span = _calls_span(messages, i, full, render, content[i])
        spans.append(span if i in eos_turns else _without_end(full, span, render))
    return full, sorted(spans)


def _turn_end(messages: list[dict[str, Any]], i: int, full: str, render: Callable) -> int:
    """Where message i's turn ends in `full`: where the rendering of ``messages[:i+1]`` ends in it."""
    if i == len(messages) - 1:
        return len(full)
    return _end_in(full, render_messages(render, messages[: i + 1]))


def _end_in(full: str, part: str) -> int:
    """Where the rendering of a conversation's first turns, `part`, ends in `full`.

    Usually `part` is a prefix of `full`. Some templates render the last message of a conversation
    differently: Qwen3 gives a last assistant turn an empty ``<think>`` block, Mistral's puts the
    system prompt into the last user turn. Then `part` is `full`'s prefix with a piece inserted
    where they part, and its end is where its longest tail that continues `full` there ends.

    >>> _end_in("<a>x<e><u>y", "<a><t>x<e>")
    7
    """
    start = _common_prefix_len(full, part)
    if start == len(part):
        return start
    for k in range(min(len(part), len(full)) - start, 0, -1):
        if part.endswith(full[start : start + k]):
            return start + k
    return start


def _stripped(full: str, start: int, end: int) -> tuple[int, int] | None:
    """The span [start, end) of `full` without its surrounding whitespace (None when nothing is left)."""
    segment = full[start:end]
    stripped = segment.strip()
    if not stripped:
        return None
    s = start + len(segment) - len(segment.lstrip())
    return s, s + len(stripped)


def _calls_span(
    messages: list[dict[str, Any]], i: int, full: str, render: Callable, content: tuple[int, int] | None
) -> tuple[int, int]:
    """The span of message i's tool calls and its end of turn: what the model writes after its text
    (or, with no text rendered, after the generation prompt) up to the end of the turn. Templates
    write calls in their own markup (``<tool_call>`` JSON, ``[TOOL_CALLS]``, a bare JSON object):
    that markup is what the model must learn to emit, so all of it is trained."""
    start = content[0] if content else _calls_start(messages, i, full, render)
    span = _stripped(full, start, _turn_end(messages, i, full, render))
    names = called_names(messages[i])
    if span is None or not all(name in full[span[0] : span[1]] for name in names):
        raise ChatTemplateError(
            TEMPLATE_WITHOUT_TOOLS,
            f"the chat template does not render the tool calls of message {i} (functions {names}): use a "
            "template that renders an assistant turn's tool_calls (set model.chat_template)",
        )
    return span


def _without_end(full: str, span: tuple[int, int], render: Callable) -> tuple[int, int]:
    """A calls span without its end-of-turn text (`train_on_eos` leaves that turn's end untrained).

    The end of a turn with calls can't be told from its markup by itself: it is the template's end of
    an assistant turn, read from a probe conversation (the text after a plain assistant reply). A
    template whose calls turn ends otherwise keeps its end trained (docs/data.md says so).
    """
    mark = _MARK.format(0)
    try:
        probe = render_messages(
            render, [{"role": "user", "content": "?"}, {"role": "assistant", "content": mark}]
        )
    except ChatTemplateError:
        return span
    at = probe.find(mark)
    end_text = probe[at + len(mark) :].strip() if at >= 0 else ""
    if not end_text or not full[span[0] : span[1]].endswith(end_text):
        return span
    return _stripped(full, span[0], span[1] - len(end_text)) or span


def _calls_start(messages: list[dict[str, Any]], i: int, full: str, render: Callable) -> int:
    """Where message i's calls start when it has no text: where the template puts its content (found
    with a marker, the text before it unchanged), else right after the generation prompt."""
    mark = _MARK.format(i)
    marked = render_messages(render, [*messages[:i], {**messages[i], "content": mark}, *messages[i + 1 :]])
    at = marked.find(mark)
    if at >= 0 and full.startswith(marked[:at]):
        return at
    prompt = render_messages(render, messages[:i], add_generation_prompt=True)
    at = _end_in(full, prompt)
    if at > _common_prefix_len(full, prompt) or full.startswith(prompt):
        return at
    raise ChatTemplateError(
        TEMPLATE_MISMATCH,
        f"could not locate where message {i}'s tool calls start in the rendered template (neither its "
        "content nor the generation prompt before it is where the conversation renders them)",
    )


def render_messages(render: Callable[..., str], messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """`render(messages, **kwargs)`, a template's failure raised as a ChatTemplateError (reason
    role_rejected)."""
    try:
        return render(messages, **kwargs)
    except Exception as e:  # the template's own raise_exception, or a Jinja error on odd input
        roles = [m.get("role") for m in messages]
        raise ChatTemplateError(
            ROLE_REJECTED, f"the chat template rejected the conversation (roles {roles}): {e}"
        ) from e


def _content_spans(
    messages: list[dict[str, Any]], full: str, render: Callable, *, needed: list[int]
) -> list[tuple[int, int] | None]:
    # A turn with only tool calls keeps its empty content: templates write it differently once it
    # has text (Qwen's newline before the calls), which would throw the walk off; _calls_start
    # finds where its calls start.
    bare = {i for i, m in enumerate(messages) if has_calls(m) and not m["content"]}
    marked = [m if i in bare else {**m, "content": _MARK.format(i)} for i, m in enumerate(messages)]
    spans = _walk(full, render_messages(render, marked), messages)
    if spans is not None:
        return spans
    spans = [None] * len(messages)
    for i in needed:
        spans[i] = None if i in bare else _exact_span(full, messages, i, render)
    return spans


def _walk(full: str, marked_text: str, messages: list[dict[str, Any]]) -> list[tuple[int, int] | None] | None:
    """Content spans from a side-by-side walk of the real and the marked rendering (None if lost)."""
    hits = list(_MARK_RE.finditer(marked_text))
    spans: list[tuple[int, int] | None] = [None] * len(messages)
    pos, prev = 0, 0  # positions in full and in marked_text
    for k, hit in enumerate(hits):
        literal = marked_text[prev : hit.start()]
        if not full.startswith(literal, pos):
            return None
        pos += len(literal)
        i = int(hit.group(1))
        if i >= len(messages) or spans[i] is not None:
            return None  # a content rendered twice: let the exact method decide
        last = k + 1 == len(hits)
        after = marked_text[hit.end() : len(marked_text) if last else hits[k + 1].start()]
        text = messages[i]["content"]
        for rendered in dict.fromkeys((text, text.strip(), text.rstrip(), text.lstrip())):
            end = pos + len(rendered)
            if full.startswith(rendered, pos) and (
                full[end:] == after if last else full.startswith(after, end)
            ):
                break
        else:
            return None
        spans[i] = (pos, end)
        pos, prev = end, hit.end()
    if not hits and full != marked_text:
        return None
    return spans


def _exact_span(
    full: str, messages: list[dict[str, Any]], i: int, render: Callable
) -> tuple[int, int] | None:
    mark = _MARK.format(i)
    marked = render_messages(render, [*messages[:i], {**messages[i], "content": mark}, *messages[i + 1 :]])
    at = marked.find(mark)
    if at < 0:
        return None  # the template doesn't show this message
    tail = marked[at + len(mark) :]
    end = len(full) - len(tail)
    if end < at or not full.startswith(marked[:at]) or not full.endswith(tail):
        raise ChatTemplateError(
            TEMPLATE_MISMATCH,
            f"could not locate message {i}'s content in the rendered template (the template changes "
            "its markup with the content); use a template that renders contents verbatim",
        )
    return at, end


def _common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix (string comparisons in C, O(n log n) at worst)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
