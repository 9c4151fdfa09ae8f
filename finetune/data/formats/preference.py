"""``preference``: a prompt and two completions, the chosen one preferred to the rejected one.

A row ``{"prompt": "2+2?", "chosen": "4", "rejected": "5"}`` is one example: ``[bos] 2+2? 4 eos``
then ``[bos] 2+2? 5 eos`` in ``input_ids`` / ``labels`` (prompts masked), ``chosen_len`` saying where
the rejected sequence starts. Each value may be a list of messages instead (then the row is rendered
with the chat template, as every row is with ``apply_chat_template``); without a prompt column the
shared start of chosen and rejected is the prompt (finetune.data.completions). The length limit
applies to the pair, the unit that is packed and never split (finetune.data.preference).

>>> from types import SimpleNamespace as NS
>>> e = NS(field_prompt="prompt", field_chosen="chosen", field_rejected="rejected", role_map={},
...        message_field_role="role", message_field_content="content")
>>> rows({"prompt": ["2+2?"], "chosen": ["4"], "rejected": ["5"]}, e)[0].completions
('4', '5')
>>> rows({"prompt": ["2+2?"], "chosen": ["4"], "rejected": ["4"]}, e)[0].reason
'identical_completions'
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import datasets

from finetune.data import completions
from finetune.data.chat import known_roles, message_keys
from finetune.data.completions import CompletionsRow
from finetune.data.encode import Encoder
from finetune.data.rows import IDENTICAL_COMPLETIONS, BadRow, Example

FEATURES = {"chosen_len": datasets.Value("int32")}
"""Per-example column besides input_ids and labels: the length of the chosen sequence."""


def columns(entry: Any, column_names: Sequence[str]) -> dict[str, str]:
    """{entry field: column} of the columns read; the prompt only when the data has it, unless the
    recipe names it."""
    cols = {"field_chosen": entry.field_chosen, "field_rejected": entry.field_rejected}
    if entry.field_prompt in column_names or "field_prompt" in getattr(entry, "model_fields_set", set()):
        cols["field_prompt"] = entry.field_prompt
    return cols


def rows(batch: dict[str, list], entry: Any) -> list[CompletionsRow | BadRow]:
    """(prompt, (chosen, rejected)) per row. A missing or null value is a bad row; an empty
    completion, or chosen equal to rejected, is a counted drop (the pair would train nothing)."""
    keys = message_keys(entry)
    known = known_roles(keys.role_map)
    prompts = completions.prompts(batch, entry.field_prompt, keys, known)
    out: list[CompletionsRow | BadRow] = []
    for prompt, chosen, rejected in zip(
        prompts, batch[entry.field_chosen], batch[entry.field_rejected], strict=True
    ):
        values = [
            prompt,
            completions.turns(chosen, entry.field_chosen, keys, known),
            completions.turns(rejected, entry.field_rejected, keys, known),
        ]
        bad = next((v for v in values if isinstance(v, BadRow)), None)
        if bad is not None:
            out.append(bad)
        elif values[1] == values[2]:
            detail = f"{entry.field_chosen!r} and {entry.field_rejected!r} are the same: the pair would train nothing"
            out.append(BadRow(entry.field_rejected, IDENTICAL_COMPLETIONS, detail, malformed=False))
        else:
            out.append(CompletionsRow(values[0], (values[1], values[2])))
    return out


def renders_chat(entry: Any, features: datasets.Features) -> bool:
    """With ``apply_chat_template``, or when a column read holds lists of messages."""
    return entry.apply_chat_template or completions.has_messages(
        features, columns(entry, list(features)).values()
    )


def tokenize(batch: dict[str, list], entry: Any, enc: Encoder) -> list[Example | BadRow]:
    """Each pair as one example, chosen then rejected (completions.completion_examples)."""
    return completions.completion_examples(
        rows(batch, entry),
        enc,
        apply_chat_template=entry.apply_chat_template,
        field=entry.field_chosen,
        mismatch_field=entry.field_rejected,
        roles_to_train=entry.roles_to_train,
        train_on_eos=entry.train_on_eos,
    )
