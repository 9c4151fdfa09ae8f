"""``prompt``: prompts alone, for online RL (train.objective grpo), the other columns kept for rewards.

A row ``{"question": "Sam had 24 cards ...", "answer": "... #### 7"}`` with ``field_prompt: question``
becomes the prompt's ids, ending where the model's answer starts: with ``apply_chat_template`` (or a
prompt that is a list of messages) the chat template renders it as a user turn followed by its
generation prompt (``<|im_start|>assistant\\n``), else the text is tokenized as it is. Nothing is
trained from the prompt itself (every label is -100): the model's own completions are, at training
time. The whole row goes along as JSON in the ``row`` column, so a reward reads any column of it
(``field_expected: answer``), whatever its type.

>>> from types import SimpleNamespace as NS
>>> prompt_messages({"q": ["2+2?", [{"role": "user", "content": "3+3?"}], None]}, NS(field_prompt="q"))[:2]
[[{'role': 'user', 'content': '2+2?'}], [{'role': 'user', 'content': '3+3?'}]]
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import datasets

from finetune.constants import IGNORE_INDEX
from finetune.data.formats.chat import conversation
from finetune.data.formats.encode import Encoder
from finetune.data.formats.rows import BadRow, Example, text
from finetune.data.sources.damage import BAD_ROW_COLUMN

FEATURES = {"row": datasets.Value("string")}


def columns(entry: Any, column_names: Sequence[str]) -> dict[str, str]:
    """{entry field: column} of the columns read."""
    return {"field_prompt": entry.field_prompt}


def renders_chat(entry: Any, features: datasets.Features) -> bool:
    """With ``apply_chat_template``, or when the prompt column holds lists of messages."""
    return entry.apply_chat_template or isinstance(
        features.get(entry.field_prompt), (list, datasets.Sequence)
    )


def prompt_messages(batch: dict[str, list], entry: Any) -> list[list[dict[str, Any]] | str | BadRow]:
    """Each row's prompt: a list of messages (a string prompt as one user turn), or the reason the row
    can't be used."""
    out: list[list[dict[str, Any]] | str | BadRow] = []
    for value in batch[entry.field_prompt]:
        if isinstance(value, list):
            out.append(conversation(value, entry.field_prompt))
            continue
        value = text(value, entry.field_prompt)
        out.append(value if isinstance(value, BadRow) else [{"role": "user", "content": value}])
    return out


def tokenize(batch: dict[str, list], entry: Any, enc: Encoder) -> list[Example | BadRow]:
    """The prompt ids of each row (rendered up to the generation prompt), no trained label, and the row."""
    prompts = prompt_messages(batch, entry)
    texts = []
    for raw, value in zip(batch[entry.field_prompt], prompts, strict=True):
        if isinstance(value, BadRow):
            texts.append("")
        elif entry.apply_chat_template or isinstance(raw, list):
            texts.append(
                enc.tokenizer.apply_chat_template(
                    value, tokenize=False, add_generation_prompt=True, chat_template=enc.chat_template
                )
            )
        else:
            texts.append(value[0]["content"])
    encoded = enc.ids(texts)
    names = [c for c in batch if c != BAD_ROW_COLUMN]
    examples: list[Example | BadRow] = []
    for k, (value, ids) in enumerate(zip(prompts, encoded, strict=True)):
        if isinstance(value, BadRow):
            examples.append(value)
            continue
        prefix = enc.prefix_ids
        if prefix and ids[: len(prefix)] != prefix:
            ids = [*prefix, *ids]
        row = json.dumps({name: batch[name][k] for name in names}, default=str, ensure_ascii=False)
        examples.append((ids, [IGNORE_INDEX] * len(ids), {"row": row}))
    return examples
