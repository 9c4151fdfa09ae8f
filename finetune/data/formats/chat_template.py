"""``chat_template``: a column holding a list of messages, rendered with the chat template.

A row ``{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}``
is rendered by the tokenizer's template (or model.chat_template); the turns of ``roles_to_train``
and their end-of-turn tokens (per ``train_on_eos``) are trained, everything with
``train_on_inputs``. ShareGPT files map their keys and roles: ``message_field_role: from``,
``message_field_content: value``, ``role_map: {human: user, gpt: assistant}``. How the trained
spans are found is finetune.data.chat.chat_spans.

>>> from types import SimpleNamespace as NS
>>> e = NS(field_messages="conversations", message_field_role="from", message_field_content="value",
...        role_map={"human": "user", "gpt": "assistant"})
>>> conversations({"conversations": [[{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]]}, e)
[[{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello'}]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import datasets

from finetune.data import encode, tool_calls
from finetune.data.chat import conversation as _conversation
from finetune.data.chat import known_roles, message_keys
from finetune.data.encode import Encoder
from finetune.data.rows import TEMPLATE_WITHOUT_TOOLS, BadRow, Example, missing_name_message, optional_column
from finetune.errors import DataError
from finetune.recipe import KNOWN_CHAT_TEMPLATES


def columns(entry: Any, column_names: Sequence[str]) -> dict[str, str]:
    """{entry field: column} of the columns read (the tools column when the data or recipe has one)."""
    return {"field_messages": entry.field_messages} | optional_column(entry, "field_tools", column_names)


def check(entry: Any, features: datasets.Features, entry_label: str) -> None:
    """Raise a DataError when the messages are structs without the entry's role or content key."""
    inner = getattr(features.get(entry.field_messages), "feature", None)  # datasets.List / LargeList
    if not isinstance(inner, dict):
        return  # not a list of structs: the keys are checked row by row
    for attr in ("message_field_role", "message_field_content"):
        key = getattr(entry, attr)
        if key not in inner:
            where = f"in the messages of column {entry.field_messages!r}"
            raise DataError(
                missing_name_message(
                    entry_label, entry.path, attr, key, list(inner), what="message key", where=where
                )
            )


def conversation(value: Any, entry: Any) -> list[dict[str, Any]] | BadRow:
    """One row's messages normalized (finetune.data.chat.conversation), or why it can't be used."""
    return _conversation(value, entry.field_messages, message_keys(entry))


def conversations(batch: dict[str, list], entry: Any) -> list[list[dict[str, Any]] | BadRow]:
    """Each row's messages as ``[{"role", "content", ...}]`` with ``role_map`` applied."""
    keys = message_keys(entry)
    known = known_roles(keys.role_map)
    return [_conversation(value, entry.field_messages, keys, known) for value in batch[entry.field_messages]]


def renders_chat(entry: Any, features: datasets.Features) -> bool:
    """Always: the rows are chats."""
    return True


def tokenize(batch: dict[str, list], entry: Any, enc: Encoder) -> list[Example | BadRow]:
    """Each conversation rendered with its row's tools and masked (encode.chat_examples)."""
    convs = conversations(batch, entry)
    if entry.field_tools not in batch:
        return encode.chat_examples(convs, enc, entry, field=entry.field_messages)
    tools = [row_tools(value, entry.field_tools, enc) for value in batch[entry.field_tools]]
    convs = [t if isinstance(t, BadRow) else c for c, t in zip(convs, tools, strict=True)]
    tools = [None if isinstance(t, BadRow) else t for t in tools]
    return encode.chat_examples(convs, enc, entry, field=entry.field_messages, tools=tools)


def row_tools(value: Any, field: str, enc: Encoder) -> list[dict[str, Any]] | BadRow | None:
    """One row's tool definitions for ``apply_chat_template(tools=...)``, or why they can't be used
    (not a list of schemas; a chat template with no ``tools`` variable, which would drop them)."""
    tools = tool_calls.tools(value, field)
    if tools and not isinstance(tools, BadRow) and not enc.renders_tools():
        return BadRow(
            field,
            TEMPLATE_WITHOUT_TOOLS,
            f"the row has tool definitions in {field!r}, but the chat template ({template_name(enc)}) has no "
            "`tools` variable, so they would be dropped; set model.chat_template to a template that "
            "renders tools (the model's own tool-calling template)",
        )
    return tools


def template_name(enc: Encoder) -> str:
    """How to name the chat template in an error: its known name, else where it comes from."""
    names = {text: name for name, text in KNOWN_CHAT_TEMPLATES.items()}
    if enc.chat_template:
        return f"model.chat_template {names.get(enc.chat_template, enc.chat_template[:60] + '...')!r}"
    return f"the tokenizer's own template, {enc.template()[:60]!r}..."
