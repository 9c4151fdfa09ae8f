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

from finetune.data import encode
from finetune.data.chat import conversation as _conversation
from finetune.data.chat import known_roles, message_keys
from finetune.data.encode import Encoder
from finetune.data.rows import BadRow, Example, missing_name_message
from finetune.errors import DataError


def columns(entry: Any, column_names: Sequence[str]) -> dict[str, str]:
    """{entry field: column} of the columns read."""
    return {"field_messages": entry.field_messages}


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
    """Each conversation rendered and masked (encode.chat_examples)."""
    return encode.chat_examples(conversations(batch, entry), enc, entry, field=entry.field_messages)
