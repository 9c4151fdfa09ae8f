"""``preference``: a prompt and two completions, the chosen one preferred to the rejected one.

A row ``{"prompt": "2+2?", "chosen": "4", "rejected": "5"}`` is one example: ``[bos] 2+2? 4 eos``
then ``[bos] 2+2? 5 eos`` in ``input_ids`` / ``labels`` (prompts masked), ``chosen_len`` saying where
the rejected sequence starts. Each value may be a list of messages instead (then the row is rendered
with the chat template, as every row is with ``apply_chat_template``); without a prompt column the
shared start of chosen and rejected is the prompt (finetune.data.completions). The length limit
applies to the pair, the unit that is packed and never split (finetune.data.preference).

For a vision-language model (model.kind vlm) the prompt may hold images: image parts in its messages,
or an ``images`` column (``field_images``) with one ``<image>`` placeholder per image in its text.
Chosen and rejected share them: both sequences get the images' tokens (finetune.data.vision.pair_images).

With ``field_margin`` (train.objective reward) each pair also carries its ``margin``, a number read from
that column (TRL's margin column).

>>> from types import SimpleNamespace as NS
>>> e = NS(field_prompt="prompt", field_chosen="chosen", field_rejected="rejected", role_map={},
...        message_field_role="role", message_field_content="content")
>>> rows({"prompt": ["2+2?"], "chosen": ["4"], "rejected": ["5"]}, e)[0].completions
('4', '5')
>>> rows({"prompt": ["2+2?"], "chosen": ["4"], "rejected": ["4"]}, e)[0].reason
'identical_completions'
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import datasets

from finetune.data import completions, images
from finetune.data.completions import CompletionsRow
from finetune.data.encode import Encoder
from finetune.data.formats.chat_template import with_row_images
from finetune.data.rows import (
    IDENTICAL_COMPLETIONS,
    MISSING_FIELD,
    WRONG_TYPE,
    BadRow,
    Example,
    optional_column,
)

FEATURES = {"chosen_len": datasets.Value("int32")}
"""Per-example column besides input_ids and labels: the length of the chosen sequence."""


def columns(entry: Any, column_names: Sequence[str]) -> dict[str, str]:
    """{entry field: column} of the columns read; the prompt only when the data has it, unless the
    recipe names it."""
    cols = {"field_chosen": entry.field_chosen, "field_rejected": entry.field_rejected}
    if getattr(entry, "field_margin", None) is not None:
        cols["field_margin"] = entry.field_margin
    return (
        cols
        | optional_column(entry, "field_prompt", column_names)
        | optional_column(entry, "field_images", column_names)
    )


def rows(batch: dict[str, list], entry: Any) -> list[CompletionsRow | BadRow]:
    """(prompt, (chosen, rejected)) per row. A missing or null value is a bad row; an empty
    completion, or chosen equal to rejected, is a counted drop (the pair would train nothing)."""
    out = completions.parsed_rows(batch, entry, (entry.field_chosen, entry.field_rejected))
    for k, row in enumerate(out):
        if not isinstance(row, BadRow) and row.completions[0] == row.completions[1]:
            detail = f"{entry.field_chosen!r} and {entry.field_rejected!r} are the same: the pair would train nothing"
            out[k] = BadRow(entry.field_rejected, IDENTICAL_COMPLETIONS, detail, malformed=False)
    return out


def renders_chat(entry: Any, features: datasets.Features) -> bool:
    """With ``apply_chat_template``, or when a column read holds lists of messages."""
    return completions.renders_chat(entry, features, columns)


def tokenize(batch: dict[str, list], entry: Any, enc: Encoder) -> list[Example | BadRow]:
    """Each pair as one example, chosen then rejected (completions.completion_examples); with a
    vision-language processor, the images column (when the data has it) placed in the prompts."""
    parsed = with_images(rows(batch, entry), batch, entry, enc)
    examples = completions.completion_examples(
        parsed, enc, entry, field=entry.field_chosen, mismatch_field=entry.field_rejected
    )
    field = getattr(entry, "field_margin", None)
    if field is None:
        return examples
    return [with_margin(example, value, field) for example, value in zip(examples, batch[field], strict=True)]


def with_margin(example: Example | BadRow, value: Any, field: str) -> Example | BadRow:
    """The pair with its `margin` column (train.objective reward), or the bad row of a value that is not a
    finite number.

    >>> with_margin(([1, 2], [-100, 2], {"chosen_len": 1}), 0.5, "m")[2]
    {'chosen_len': 1, 'margin': 0.5}
    >>> with_margin(([1, 2], [-100, 2], {"chosen_len": 1}), "big", "m").reason
    'wrong_type'
    """
    if isinstance(example, BadRow):
        return example
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        detail = f"{field!r} should be a finite number (the pair's margin), got {value!r}"
        return BadRow(field, MISSING_FIELD if value is None else WRONG_TYPE, detail)
    ids, labels, extra = example
    return ids, labels, {**extra, "margin": float(value)}


def with_images(parsed: list, batch: dict[str, list], entry: Any, enc: Encoder) -> list:
    """The parsed rows with the images column (when the data has it) placed in their prompts
    (`row_images`): read for a vision-language model, or when the recipe names field_images (as the
    chat_template type does). Shared by the preference and kto types."""
    named = "field_images" in getattr(entry, "model_fields_set", set())
    if entry.field_images not in batch or (enc.processor is None and not named):
        return parsed
    return [
        row_images(row, refs, entry.field_images, entry.field_prompt)
        for row, refs in zip(parsed, batch[entry.field_images], strict=True)
    ]


def row_images(
    row: CompletionsRow | BadRow, refs: Any, field: str, prompt_field: str
) -> CompletionsRow | BadRow:
    """LLaVA style: a pair's image list (column `field`) put where its prompt's ``<image>`` placeholders
    are (a string prompt becomes a user turn, so the chat template places the images); a row without a
    prompt, or with a different number of placeholders than images, is a bad row.

    >>> row = row_images(CompletionsRow("<image>Colour?", ("red", "blue")), ["a.png"], "images", "prompt")
    >>> row.prompt
    [{'role': 'user', 'content': '\ue002Colour?', 'images': ['a.png']}]
    """
    if isinstance(row, BadRow) or refs is None:
        return row
    if row.prompt is None:
        detail = f"the row has images in {field!r} but no {prompt_field!r} column to place them in"
        return BadRow(field, images.IMAGE_COUNT_MISMATCH, detail)
    prompt = [{"role": "user", "content": row.prompt}] if isinstance(row.prompt, str) else row.prompt
    placed = with_row_images(prompt, refs, field)
    return placed if isinstance(placed, BadRow) else dataclasses.replace(row, prompt=placed)
