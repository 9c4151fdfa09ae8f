"""``alpaca``: an instruction, an optional input (context) and the response to train.

A row ``{"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}`` becomes the Stanford
Alpaca prompt (masked unless ``train_on_inputs``) followed by the output and the eos:
``[bos] <prompt with ### Instruction / ### Input / ### Response:\\n> 5 eos``. With
``apply_chat_template`` the instruction (and the input after a blank line) is a user turn and the
output an assistant turn, rendered by the chat template. A null or absent input counts as empty.

>>> alpaca_prompt("Add the numbers.", "2 and 3").endswith("### Input:\\n2 and 3\\n\\n### Response:\\n")
True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import datasets

from finetune.data.formats import encode
from finetune.data.formats.encode import Encoder
from finetune.data.formats.rows import WRONG_TYPE, BadRow, Example, optional_column, pair, text

ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
"""The Stanford Alpaca prompt for rows with a non-empty input. Formatted with ``instruction`` and
``input``; the response is appended right after ``### Response:\\n`` and followed by the eos token.
Everything up to and including ``### Response:\\n`` is the prompt (masked unless train_on_inputs)."""

ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
"""The Stanford Alpaca prompt for rows whose input is empty, null or absent (no ``### Input:``
section). Formatted with ``instruction``."""


def alpaca_prompt(instruction: str, input_text: str | None) -> str:
    """The Alpaca prompt for one row (the input section only when the input is non-empty).

    >>> alpaca_prompt("Say hi.", "").endswith("### Instruction:\\nSay hi.\\n\\n### Response:\\n")
    True
    """
    if input_text:
        return ALPACA_PROMPT_WITH_INPUT.format(instruction=instruction, input=input_text)
    return ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)


def user_text(instruction: str, input_text: str | None) -> str:
    """An alpaca row as the user's turn of a chat: the instruction, then the input after a blank line.

    >>> user_text("Add the numbers.", "2 and 3"), user_text("Say hi.", None)
    ('Add the numbers.\\n\\n2 and 3', 'Say hi.')
    """
    return f"{instruction}\n\n{input_text}" if input_text else instruction


def columns(entry: Any, column_names: Sequence[str]) -> dict[str, str]:
    """{entry field: column} of the columns read; the input only when the data has it, unless the
    recipe names it (then a missing one is an error, not a silent fallback to no input)."""
    cols = {"field_instruction": entry.field_instruction, "field_output": entry.field_output}
    return cols | optional_column(entry, "field_input", column_names)


def pairs(batch: dict[str, list], entry: Any) -> list[tuple[str, str] | BadRow]:
    """(prompt, output) per row: the Alpaca prompt, or with ``apply_chat_template`` the user's text.

    A null instruction or output is a bad row, an output that is empty or only whitespace a counted
    drop (``empty_completion``, unless ``train_on_inputs``).
    """
    n = len(batch[entry.field_instruction])
    inputs = batch.get(entry.field_input) or [None] * n
    prompt = user_text if entry.apply_chat_template else alpaca_prompt
    out: list[tuple[str, str] | BadRow] = []
    for instr, inp, output in zip(
        batch[entry.field_instruction], inputs, batch[entry.field_output], strict=True
    ):
        instr, output = text(instr, entry.field_instruction), text(output, entry.field_output)
        if inp is not None and not isinstance(inp, str):
            out.append(BadRow(entry.field_input, WRONG_TYPE, f"{entry.field_input!r} should be a string"))
        elif isinstance(instr, str):
            out.append(
                pair(prompt(instr, inp), output, entry.field_output, train_on_inputs=entry.train_on_inputs)
            )
        else:
            out.append(instr)
    return out


def renders_chat(entry: Any, features: datasets.Features) -> bool:
    """Whether rows are rendered with the chat template: with ``apply_chat_template``."""
    return entry.apply_chat_template


def tokenize(batch: dict[str, list], entry: Any, enc: Encoder) -> list[Example | BadRow]:
    """The pairs as prompt and completion, or as a chat (encode.pair_examples)."""
    return encode.pair_examples(pairs(batch, entry), enc, entry, field=entry.field_output)
