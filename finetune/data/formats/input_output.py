"""``input_output``: a prompt column and a completion column.

A row ``{"prompt": "2+2?", "completion": "4"}`` becomes ``[bos] 2+2? 4 eos``, the prompt masked
unless ``train_on_inputs`` (columns ``field_prompt`` and ``field_completion``). With
``apply_chat_template`` the prompt is a user turn and the completion an assistant turn, rendered by
the chat template: GSM8K is ``{type: input_output, field_prompt: question, field_completion: answer,
apply_chat_template: true}``.

>>> from types import SimpleNamespace as NS
>>> e = NS(field_prompt="question", field_completion="answer", train_on_inputs=False)
>>> pairs({"question": ["2+2?", "3+3?"], "answer": ["4", ""]}, e)[0]
('2+2?', '4')
>>> pairs({"question": ["2+2?", "3+3?"], "answer": ["4", ""]}, e)[1].reason
'empty_completion'
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import datasets

from finetune.data.formats import encode
from finetune.data.formats.encode import Encoder
from finetune.data.formats.rows import BadRow, Example, pair, text


def columns(entry: Any, column_names: Sequence[str]) -> dict[str, str]:
    """{entry field: column} of the columns read."""
    return {"field_prompt": entry.field_prompt, "field_completion": entry.field_completion}


def pairs(batch: dict[str, list], entry: Any) -> list[tuple[str, str] | BadRow]:
    """(prompt, completion) per row; a null one is a bad row, an empty completion a counted drop
    (unless ``train_on_inputs``)."""
    fields = (entry.field_prompt, entry.field_completion)
    return [
        pair(text(p, fields[0]), text(c, fields[1]), fields[1], train_on_inputs=entry.train_on_inputs)
        for p, c in zip(*(batch[f] for f in fields), strict=True)
    ]


def renders_chat(entry: Any, features: datasets.Features) -> bool:
    """Whether rows are rendered with the chat template: with ``apply_chat_template``."""
    return entry.apply_chat_template


def tokenize(batch: dict[str, list], entry: Any, enc: Encoder) -> list[Example | BadRow]:
    """The pairs as prompt and completion, or as a chat (encode.pair_examples)."""
    return encode.pair_examples(pairs(batch, entry), enc, entry, field=entry.field_completion)
