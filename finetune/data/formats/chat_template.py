"""``chat_template``: a column holding a list of messages, rendered with the chat template.

A row ``{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}``
is rendered by the tokenizer's template (or model.chat_template); the turns of ``roles_to_train``
and their end-of-turn tokens (per ``train_on_eos``) are trained, everything with
``train_on_inputs``. ShareGPT files map their keys and roles: ``message_field_role: from``,
``message_field_content: value``, ``role_map: {human: user, gpt: assistant}``. How the trained
spans are found is finetune.data.formats.chat.chat_spans.

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

from finetune.data.formats import encode, images
from finetune.data.formats.chat import conversation as _conversation
from finetune.data.formats.chat import known_roles, message_keys, tool_definitions
from finetune.data.formats.encode import Encoder
from finetune.data.formats.rows import (
    TEMPLATE_WITHOUT_TOOLS,
    WRONG_TYPE,
    BadRow,
    Example,
    missing_name_message,
    optional_column,
)
from finetune.errors import DataError
from finetune.recipe import KNOWN_CHAT_TEMPLATES


def columns(entry: Any, column_names: Sequence[str]) -> dict[str, str]:
    """{entry field: column} of the columns read (the tools and images columns when the data or recipe
    has them)."""
    return (
        {"field_messages": entry.field_messages}
        | optional_column(entry, "field_tools", column_names)
        | optional_column(entry, "field_images", column_names)
    )


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
    """One row's messages normalized (finetune.data.formats.chat.conversation), or why it can't be used."""
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
    """Each conversation rendered with its row's tools and masked (encode.chat_examples); with images,
    for a vision-language model, their tokens expanded and their bytes kept (`image_examples`)."""
    convs = conversations(batch, entry)
    # The images column is read for a vision-language model, or when the recipe names it (a text recipe
    # whose data merely has an `images` column keeps working as before).
    named = "field_images" in getattr(entry, "model_fields_set", set())
    if entry.field_images in batch and (enc.processor is not None or named):
        convs = [
            with_row_images(c, refs, entry.field_images)
            for c, refs in zip(convs, batch[entry.field_images], strict=True)
        ]
    if enc.processor is None:
        convs = [images_need_vlm(c, entry.field_messages) for c in convs]
    examples = image_examples if enc.processor is not None else encode.chat_examples
    if entry.field_tools not in batch:
        return examples(convs, enc, entry, field=entry.field_messages)
    tools = [row_tools(value, entry.field_tools, enc) for value in batch[entry.field_tools]]
    convs = [t if isinstance(t, BadRow) else c for c, t in zip(convs, tools, strict=True)]
    tools = [None if isinstance(t, BadRow) else t for t in tools]
    return examples(convs, enc, entry, field=entry.field_messages, tools=tools)


def image_examples(
    convs: list[list[dict[str, Any]] | BadRow],
    enc: Encoder,
    entry: Any,
    *,
    field: str,
    tools: list[list[dict[str, Any]] | None] | None = None,
) -> list[Example | BadRow]:
    """Each conversation as (ids, labels, {"images": [bytes]}): rendered, masked (as
    encode.chat_examples) and its images expanded into their tokens; or the row's BadRow."""
    loaded = [c if isinstance(c, BadRow) else encode.load_images(c, enc, field) for c in convs]
    convs = [img if isinstance(img, BadRow) else c for c, img in zip(convs, loaded, strict=True)]
    texts, found = encode.chat_texts(convs, enc, entry, field=field, tools=tools)
    rows: list[Example | BadRow] = []
    for text, spans, encoding, imgs in zip(
        texts, found, enc.encode(texts, offsets=True), loaded, strict=True
    ):
        if isinstance(spans, BadRow):
            rows.append(spans)
            continue
        ids, labels = enc.labelled(encoding, None if entry.train_on_inputs else spans)
        if imgs:
            expanded = encode.expand(enc, text, imgs, ids, labels, field=field)
            if isinstance(expanded, BadRow):
                rows.append(expanded)
                continue
            ids, labels = expanded
        rows.append((ids, labels, {"images": imgs}))
    return rows


def with_row_images(
    conv: list[dict[str, Any]] | BadRow, refs: Any, field: str
) -> list[dict[str, Any]] | BadRow:
    """LLaVA style: the row's image list (column `field`) put where the messages' ``<image>``
    placeholders are, one per placeholder in order (a different count is a bad row)."""
    if isinstance(conv, BadRow) or refs is None:
        return conv
    if not isinstance(refs, list):
        return BadRow(field, WRONG_TYPE, f"{field!r} should be a list of images, got {type(refs).__name__}")
    out, start = [], 0
    whole = images.placeholders("".join(m["content"] for m in conv), refs, field)
    if isinstance(whole, BadRow):
        return whole
    for message in conv:
        count = message["content"].count(images.IMAGE_PLACEHOLDER)
        content = message["content"].replace(images.IMAGE_PLACEHOLDER, images.SENTINEL)
        extra = {"images": [*message.get("images", []), *refs[start : start + count]]} if count else {}
        out.append({**message, "content": content, **extra})
        start += count
    return out


def images_need_vlm(conv: list[dict[str, Any]] | BadRow, field: str) -> list[dict[str, Any]] | BadRow:
    """A row with images is refused when the model reads only text (its images would be lost)."""
    if isinstance(conv, BadRow) or not any(m.get("images") for m in conv):
        return conv
    return BadRow(
        field,
        images.IMAGES_NEED_VLM,
        "the row has images, but the model reads only text; for a vision-language model set model.kind: vlm "
        "(its processor then reads the images), or remove the image parts",
    )


def row_tools(value: Any, field: str, enc: Encoder) -> list[dict[str, Any]] | BadRow | None:
    """One row's tool definitions for ``apply_chat_template(tools=...)``, or why they can't be used
    (not a list of schemas; a chat template with no ``tools`` variable, which would drop them)."""
    tools = tool_definitions(value, field)
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
