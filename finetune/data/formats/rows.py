"""What every data format shares about raw rows: the bad row, its reasons, and checks of one value.

The batch functions of the formats (finetune/data/formats/) never raise on a malformed row: they
return a ``BadRow`` in its place, so that ``data.on_bad_row`` decides between an error naming the
row and a counted skip. A well-formed row that would train nothing (an empty output) is a
``BadRow`` with ``malformed=False``: dropped and counted under its reason alone, never an error.

>>> text(None, "output"), text("done", "output")
(BadRow(field='output', reason='missing_field', detail="'output' is missing or null", malformed=True), 'done')
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from finetune.data.sources.damage import BAD_ROW_COLUMN

# Bad-row reasons (the manifest counts them as "bad_row:<reason>").
MISSING_FIELD = "missing_field"
WRONG_TYPE = "wrong_type"
EMPTY_CONVERSATION = "empty_conversation"
ROLE_REJECTED = "role_rejected"
UNKNOWN_ROLE = "unknown_role"
NOT_A_BOOLEAN = "not_a_boolean"
# ... of pre-tokenized rows and of chat templates.
OUT_OF_VOCAB = "out_of_vocab"
LENGTH_MISMATCH = "length_mismatch"
TEMPLATE_MISMATCH = "template_mismatch"
PREFIX_MISMATCH = "prefix_mismatch"
# A row with tools or tool calls that the chat template can't render: an error whatever
# data.on_bad_row says (every such row would lose them: the template is at fault, not the row).
TEMPLATE_WITHOUT_TOOLS = "template_without_tools"
# Drop reasons (not bad rows): the output / completion / trained turns are empty; a preference pair
# whose chosen and rejected completions are the same (it would train nothing).
EMPTY_COMPLETION = "empty_completion"
IDENTICAL_COMPLETIONS = "identical_completions"

Example = tuple[list[int], list[int]] | tuple[list[int], list[int], dict[str, Any]]
"""A tokenized row: (input_ids, labels), plus its per-example columns (preference: chosen_len; kto:
desirable, prompt_len) when the format has any."""


@dataclass(frozen=True)
class BadRow:
    """Why one row can't be used: the field at fault, a reason key, and a sentence for humans.

    ``malformed=False`` marks a well-formed row that would train nothing: it is dropped and
    counted under ``reason`` alone (not ``bad_row:<reason>``) and never raises.
    """

    field: str
    reason: str
    detail: str
    malformed: bool = True

    @property
    def drop_key(self) -> str:
        """The manifest's name for this drop.

        >>> BadRow("output", "missing_field", "").drop_key, BadRow("output", "empty_completion", "", False).drop_key
        ('bad_row:missing_field', 'empty_completion')
        """
        return f"bad_row:{self.reason}" if self.malformed else self.reason


def text(value: Any, field: str) -> str | BadRow:
    """A string value, or the bad row of a null or non-string one."""
    if value is None:
        return BadRow(field, MISSING_FIELD, f"{field!r} is missing or null")
    if not isinstance(value, str):
        return BadRow(field, WRONG_TYPE, f"{field!r} should be a string, got {type(value).__name__}")
    return value


def pair(
    prompt: str | BadRow, completion: str | BadRow, field: str, *, train_on_inputs: bool
) -> tuple[str, str] | BadRow:
    """(prompt, completion), the first bad value, or a counted drop when the completion is empty or
    only whitespace (unless `train_on_inputs`: then the prompt trains).

    >>> pair("2+2?", " ", "answer", train_on_inputs=False).reason
    'empty_completion'
    """
    if isinstance(prompt, BadRow):
        return prompt
    if isinstance(completion, BadRow):
        return completion
    if not completion.strip() and not train_on_inputs:
        return BadRow(field, EMPTY_COMPLETION, empty_detail(field, completion), malformed=False)
    return prompt, completion


def empty_detail(field: str, value: str) -> str:
    """The detail of an `EMPTY_COMPLETION` drop."""
    what = "empty" if not value else f"only whitespace ({value!r})"
    return f"{field!r} is {what}: the row would train nothing"


def optional_column(entry: Any, attr: str, column_names: Sequence[str]) -> dict[str, str]:
    """{attr: column} for an optional column of an entry's mapping: when the data has it, or when the
    recipe names it (then a missing one is an error, not a silent fallback); else {}.

    >>> from types import SimpleNamespace as NS
    >>> optional_column(NS(field_input="input"), "field_input", ["instruction"])
    {}
    """
    column = getattr(entry, attr)
    if column in column_names or attr in getattr(entry, "model_fields_set", set()):
        return {attr: column}
    return {}


def missing_name_message(
    label: str, path: str, attr: str, name: str, existing: list[str], *, what: str = "column", where: str = ""
) -> str:
    """The error for a column (or message key) that an entry's mapping names and the data lacks.

    `label` is the entry's recipe path (``data.datasets[0]``), `path` its source, `attr` the mapping
    field, `where` where the name was looked for (default: in the dataset).
    """
    existing = [c for c in existing if c != BAD_ROW_COLUMN]
    hint = difflib.get_close_matches(name, existing, n=1)
    did_you_mean = f" Did you mean {hint[0]!r}?" if hint else ""
    return (
        f"{label} ({path}): {what} {name!r} (from {label}.{attr}) is not {where or 'in the dataset'}; "
        f"{what}s that exist: {existing}.{did_you_mean} "
        f"Set {label}.{attr} to the {what} that holds this field."
    )
