"""``kto``: a prompt and one completion, labelled desirable or not.

A row ``{"prompt": "2+2?", "completion": "4", "label": true}`` is one example ``[bos] 2+2? 4 eos``
(the prompt masked) with ``desirable`` (the label) and ``prompt_len``. The prompt and completion may
be lists of messages instead (then the row is rendered with the chat template, as every row is with
``apply_chat_template``); without a prompt column a conversation's last message is the completion.
The label must be a boolean (or 0/1).

For a vision-language model (model.kind vlm) the prompt may hold images, as a preference pair's does
(finetune.data.formats.preference): image parts in its messages, or an ``images`` column
(``field_images``) with one ``<image>`` placeholder per image in its text; an image in the completion
is a bad row (finetune.data.formats.preference.pair_images).

>>> from types import SimpleNamespace as NS
>>> e = NS(field_prompt="prompt", field_completion="completion", field_label="label", role_map={},
...        message_field_role="role", message_field_content="content")
>>> rows({"prompt": ["2+2?"], "completion": ["4"], "label": [True]}, e)[0].desirable
True
>>> rows({"prompt": ["2+2?"], "completion": ["4"], "label": ["yes"]}, e)[0].reason
'not_a_boolean'
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import datasets

from finetune.data.formats.encode import Encoder
from finetune.data.formats.preference import (
    CompletionsRow,
    chat_rendered,
    completion_examples,
    parsed_rows,
    with_images,
)
from finetune.data.formats.rows import MISSING_FIELD, NOT_A_BOOLEAN, BadRow, Example, optional_column

FEATURES = {"desirable": datasets.Value("bool"), "prompt_len": datasets.Value("int32")}
"""Per-example columns besides input_ids and labels: the label, and where the completion starts."""


def columns(entry: Any, column_names: Sequence[str]) -> dict[str, str]:
    """{entry field: column} of the columns read; the prompt only when the data has it, unless the
    recipe names it."""
    cols = {"field_completion": entry.field_completion, "field_label": entry.field_label}
    return (
        cols
        | optional_column(entry, "field_prompt", column_names)
        | optional_column(entry, "field_images", column_names)
    )


def rows(batch: dict[str, list], entry: Any) -> list[CompletionsRow | BadRow]:
    """(prompt, (completion,), desirable) per row, or why it can't be used (the prompt's or the
    completion's problem before the label's)."""
    parsed = parsed_rows(batch, entry, (entry.field_completion,))
    out: list[CompletionsRow | BadRow] = []
    for row, label in zip(parsed, batch[entry.field_label], strict=True):
        desirable = boolean(label, entry.field_label)
        if isinstance(row, BadRow) or isinstance(desirable, BadRow):
            out.append(row if isinstance(row, BadRow) else desirable)
        else:
            out.append(CompletionsRow(row.prompt, row.completions, desirable))
    return out


def boolean(value: Any, field: str) -> bool | BadRow:
    """A label: true or false (or 1 or 0), else a bad row."""
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    if value is None:
        return BadRow(field, MISSING_FIELD, f"{field!r} is missing or null")
    return BadRow(
        field, NOT_A_BOOLEAN, f"{field!r} should be true (desirable) or false (undesirable), got {value!r}"
    )


def renders_chat(entry: Any, features: datasets.Features) -> bool:
    """With ``apply_chat_template``, or when a column read holds lists of messages."""
    return chat_rendered(entry, features, columns)


def tokenize(batch: dict[str, list], entry: Any, enc: Encoder) -> list[Example | BadRow]:
    """Each example (finetune.data.formats.preference, as for preference pairs); with a vision-language processor, the images
    column (when the data has it) placed in the prompts, as for preference pairs."""
    parsed = with_images(rows(batch, entry), batch, entry, enc)
    # One completion: no shared prefix to mismatch, so mismatch_field is never named.
    return completion_examples(
        parsed, enc, entry, field=entry.field_completion, mismatch_field=entry.field_completion
    )
