"""Row formats: which columns an entry reads, and how a batch of raw rows becomes normalized pieces.

Every format is reduced to one of three shapes before tokenization (see finetune/data/tokenize.py):

* ``completion``: one text, trained whole.
* ``alpaca`` and ``input_output``: a (prompt, completion) pair; the prompt is masked unless
  ``train_on_inputs``. With ``apply_chat_template: true`` the pair becomes a user turn and an
  assistant turn (`pair_conversations`), rendered like ``chat_template`` rows.
* ``chat_template``: a list of ``{"role", "content", ...}`` messages rendered by a chat template.
* ``preference`` and ``kto``: a prompt and completions (two for a preference pair, chosen then
  rejected; one labelled desirable or not for kto), each a string or a list of messages
  (`preference_rows`, `kto_rows`); message lists are rendered with the chat template
  (`completion_conversations`).

``tokenized`` rows are already ids and are only checked (in tokenize.py).

The batch functions never raise on a malformed row: they return a ``BadRow`` in its place, so that
``data.on_bad_row`` decides between an error naming the row and a counted skip. A well-formed row
that would train nothing (an empty output) is a ``BadRow`` with ``malformed=False``: dropped and
counted under its reason alone, never an error.

>>> alpaca_prompt("Add the numbers.", "2 and 3").endswith("### Input:\\n2 and 3\\n\\n### Response:\\n")
True
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from finetune.data.damage import BAD_ROW_COLUMN
from finetune.errors import DataError

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

# Bad-row reasons (the manifest counts them as "bad_row:<reason>").
MISSING_FIELD = "missing_field"
WRONG_TYPE = "wrong_type"
EMPTY_CONVERSATION = "empty_conversation"
ROLE_REJECTED = "role_rejected"
UNKNOWN_ROLE = "unknown_role"
NOT_A_BOOLEAN = "not_a_boolean"
# Drop reasons (not bad rows): the output / completion / trained turns are empty; a preference pair
# whose chosen and rejected completions are the same (it would train nothing).
EMPTY_COMPLETION = "empty_completion"
IDENTICAL_COMPLETIONS = "identical_completions"

DEFAULT_ROLES = ("system", "user", "assistant", "tool")
"""The roles chat templates know. Others are known only as targets of the entry's ``role_map``
(map a role to itself, ``{ipython: ipython}``, to declare one the template supports)."""


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


def known_roles(entry: Any) -> set[str]:
    """The roles an entry's messages may have after ``role_map``: the defaults and the map's targets.

    >>> from types import SimpleNamespace as NS
    >>> sorted(known_roles(NS(role_map={"human": "user", "ipython": "ipython"})))
    ['assistant', 'ipython', 'system', 'tool', 'user']
    """
    return {*DEFAULT_ROLES, *entry.role_map.values()}


def alpaca_prompt(instruction: str, input_text: str | None) -> str:
    """The Alpaca prompt for one row (the input section only when the input is non-empty).

    >>> alpaca_prompt("Say hi.", "").endswith("### Instruction:\\nSay hi.\\n\\n### Response:\\n")
    True
    """
    if input_text:
        return ALPACA_PROMPT_WITH_INPUT.format(instruction=instruction, input=input_text)
    return ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)


# ------------------------------------------------------------------------------------------ columns


def columns_read(entry: Any, column_names: Sequence[str]) -> dict[str, str]:
    """The columns an entry's format reads, as {entry attribute: column name}.

    Optional columns are included only when present, except when the user set the mapping
    explicitly (then a missing one is an error, not a silent fallback).
    """
    explicit = getattr(entry, "model_fields_set", set())
    if entry.type == "completion":
        return {"field_text": entry.field_text}
    if entry.type == "alpaca":
        cols = {"field_instruction": entry.field_instruction, "field_output": entry.field_output}
        if entry.field_input in column_names or "field_input" in explicit:
            cols["field_input"] = entry.field_input
        return cols
    if entry.type == "input_output":
        return {"field_prompt": entry.field_prompt, "field_completion": entry.field_completion}
    if entry.type == "chat_template":
        return {"field_messages": entry.field_messages}
    if entry.type == "tokenized":
        return {"input_ids": "input_ids"} | ({"labels": "labels"} if "labels" in column_names else {})
    if entry.type == "preference":
        cols = {"field_chosen": entry.field_chosen, "field_rejected": entry.field_rejected}
        if entry.field_prompt in column_names or "field_prompt" in explicit:
            cols["field_prompt"] = entry.field_prompt
        return cols
    if entry.type == "kto":
        cols = {"field_completion": entry.field_completion, "field_label": entry.field_label}
        if entry.field_prompt in column_names or "field_prompt" in explicit:
            cols["field_prompt"] = entry.field_prompt
        return cols
    raise DataError(f"unknown dataset type {entry.type!r}")


def check_columns(
    entry: Any, column_names: Sequence[str], *, features: Any = None, entry_label: str = "data.datasets[0]"
) -> None:
    """Raise a DataError when a column (or message key) the entry's mapping names doesn't exist.

    ``features`` (a ``datasets.Features``) lets chat entries check the message keys up front when
    the messages column is a list of structs.
    """
    for attr, column in columns_read(entry, column_names).items():
        if column not in column_names:
            raise DataError(
                _missing_name_message(entry, entry_label, attr, column, list(column_names), what="column")
            )
    if entry.type == "chat_template" and features is not None:
        keys = _message_keys(features.get(entry.field_messages))
        if keys is not None:
            for attr in ("message_field_role", "message_field_content"):
                key = getattr(entry, attr)
                if key not in keys:
                    raise DataError(
                        _missing_name_message(entry, entry_label, attr, key, keys, what="message key")
                    )


def _message_keys(feature: Any) -> list[str] | None:
    """Keys of the message structs when the column is a list of structs, else None (unknown)."""
    inner = getattr(feature, "feature", None)  # datasets.List / Sequence / LargeList
    if isinstance(inner, dict):
        return list(inner)
    return None


def _missing_name_message(
    entry: Any, label: str, attr: str, name: str, existing: list[str], *, what: str
) -> str:
    existing = [c for c in existing if c != BAD_ROW_COLUMN]
    hint = difflib.get_close_matches(name, existing, n=1)
    did_you_mean = f" Did you mean {hint[0]!r}?" if hint else ""
    where = "in the dataset" if what == "column" else f"in the messages of column {entry.field_messages!r}"
    return (
        f"{label} ({entry.path}): {what} {name!r} (from {label}.{attr}) is not {where}; "
        f"{what}s that exist: {existing}.{did_you_mean} "
        f"Set {label}.{attr} to the {what} that holds this field."
    )


# ------------------------------------------------------------------------------------------- batches


def _text(value: Any, field: str) -> str | BadRow:
    if value is None:
        return BadRow(field, MISSING_FIELD, f"{field!r} is missing or null")
    if not isinstance(value, str):
        return BadRow(field, WRONG_TYPE, f"{field!r} should be a string, got {type(value).__name__}")
    return value


def completion_texts(batch: dict[str, list], entry: Any) -> list[str | BadRow]:
    """The text of each row of a ``completion`` batch."""
    return [_text(v, entry.field_text) for v in batch[entry.field_text]]


def prompt_completion_pairs(batch: dict[str, list], entry: Any) -> list[tuple[str, str] | BadRow]:
    """(prompt, completion) for each row of an ``alpaca`` or ``input_output`` batch.

    Alpaca rows get the prompt template above, or with ``apply_chat_template`` the bare
    instruction (and input, after a blank line) as the user's text. A null or absent input counts
    as empty (it is optional), a null instruction or output is a bad row, and an output that is
    empty or only whitespace is dropped as ``empty_completion`` (unless ``train_on_inputs``).
    """
    if entry.type == "input_output":
        fields = (entry.field_prompt, entry.field_completion)
        return [
            _pair(_text(p, fields[0]), _text(c, fields[1]), fields[1], entry)
            for p, c in zip(*(batch[f] for f in fields), strict=True)
        ]
    n = len(batch[entry.field_instruction])
    inputs = batch.get(entry.field_input) or [None] * n
    prompt = user_text if entry.apply_chat_template else alpaca_prompt
    out: list[tuple[str, str] | BadRow] = []
    for instr, inp, output in zip(
        batch[entry.field_instruction], inputs, batch[entry.field_output], strict=True
    ):
        instr, output = _text(instr, entry.field_instruction), _text(output, entry.field_output)
        if inp is not None and not isinstance(inp, str):
            out.append(BadRow(entry.field_input, WRONG_TYPE, f"{entry.field_input!r} should be a string"))
        elif isinstance(instr, str):
            out.append(_pair(prompt(instr, inp), output, entry.field_output, entry))
        else:
            out.append(instr)
    return out


def user_text(instruction: str, input_text: str | None) -> str:
    """An alpaca row as the user's turn of a chat: the instruction, then the input after a blank line.

    >>> user_text("Add the numbers.", "2 and 3"), user_text("Say hi.", None)
    ('Add the numbers.\\n\\n2 and 3', 'Say hi.')
    """
    return f"{instruction}\n\n{input_text}" if input_text else instruction


def _pair(prompt: str | BadRow, completion: str | BadRow, field: str, entry: Any) -> tuple[str, str] | BadRow:
    if isinstance(prompt, BadRow):
        return prompt
    if isinstance(completion, BadRow):
        return completion
    if not completion.strip() and not entry.train_on_inputs:  # with train_on_inputs the prompt trains
        return BadRow(field, EMPTY_COMPLETION, _empty_detail(field, completion), malformed=False)
    return prompt, completion


def _empty_detail(field: str, value: str) -> str:
    what = "empty" if not value else f"only whitespace ({value!r})"
    return f"{field!r} is {what}: the row would train nothing"


def pair_conversations(batch: dict[str, list], entry: Any) -> list[list[dict[str, str]] | BadRow]:
    """Each (prompt, completion) pair as a user turn and an assistant turn, for the chat template.

    >>> from types import SimpleNamespace as NS
    >>> e = NS(type="input_output", field_prompt="question", field_completion="answer", train_on_inputs=False)
    >>> pair_conversations({"question": ["2+2?"], "answer": ["4"]}, e)
    [[{'role': 'user', 'content': '2+2?'}, {'role': 'assistant', 'content': '4'}]]
    """
    return [
        pair
        if isinstance(pair, BadRow)
        else [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
        for pair in prompt_completion_pairs(batch, entry)
    ]


def conversations(batch: dict[str, list], entry: Any) -> list[list[dict[str, Any]] | BadRow]:
    """Each row's messages as ``[{"role", "content", ...}]`` with ``role_map`` applied.

    Other keys of a message (e.g. ``tool_calls``) are kept for the template; nulls are dropped.
    """
    known = known_roles(entry)
    return [conversation(value, entry, known) for value in batch[entry.field_messages]]


def conversation(
    value: Any, entry: Any, known: set[str] | None = None, *, field: str | None = None
) -> list[dict[str, Any]] | BadRow:
    """One row's messages, normalized (see `conversations`), or the reason it can't be used.

    A role that is not in ``known`` (default: `known_roles`) after ``role_map`` is a bad row:
    templates render any role string, so a typo or an unmapped ShareGPT role would otherwise
    train silently in the wrong shape. ``field`` names the column in problems (default:
    ``entry.field_messages``).

    >>> from types import SimpleNamespace as NS
    >>> e = NS(field_messages="conversations", message_field_role="from", message_field_content="value",
    ...        role_map={"human": "user", "gpt": "assistant"})
    >>> conversation([{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}], e)
    [{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello'}]
    >>> conversation([{"from": "wizard", "value": "Hi"}], e).reason
    'unknown_role'
    """
    role_key, content_key = entry.message_field_role, entry.message_field_content
    field = entry.field_messages if field is None else field
    known = known_roles(entry) if known is None else known
    if value is None:
        return BadRow(field, MISSING_FIELD, f"{field!r} is missing or null")
    if not isinstance(value, list):
        return BadRow(
            field, WRONG_TYPE, f"{field!r} should be a list of messages, got {type(value).__name__}"
        )
    if not value:
        return BadRow(field, EMPTY_CONVERSATION, f"{field!r} is an empty list of messages")
    messages = []
    for j, msg in enumerate(value):
        where = f"{field}[{j}]"
        if not isinstance(msg, dict):
            return BadRow(where, WRONG_TYPE, f"message {j} should be a mapping, got {type(msg).__name__}")
        role, content = _text(msg.get(role_key), f"{where}.{role_key}"), msg.get(content_key)
        if isinstance(role, BadRow):
            return role
        content = _text(content, f"{where}.{content_key}")
        if isinstance(content, BadRow):
            return content
        role = entry.role_map.get(role, role)
        if role not in known:  # role_map targets are known: only a role the map left alone gets here
            return BadRow(f"{where}.{role_key}", UNKNOWN_ROLE, _unknown_role_detail(j, role, known))
        extra = {k: v for k, v in msg.items() if k not in (role_key, content_key) and v is not None}
        messages.append({**extra, "role": role, "content": content})
    return messages


def _unknown_role_detail(j: int, role: str, known: set[str]) -> str:
    return (
        f"message {j} has role {role!r}, which is not a chat role ({', '.join(sorted(known))}); map it with "
        f"role_map, e.g. {{{role}: user}}, or, if the chat template has this role, to itself: {{{role}: {role}}}"
    )


# ----------------------------------------------------------------------------- preference and kto


@dataclass(frozen=True)
class CompletionsRow:
    """A prompt and the completions scored given it: (chosen, rejected) for a preference pair, one for
    kto (``desirable`` says whether it is). Each is a string or a list of messages; ``prompt`` is None
    when the row has none (preference: the shared start of chosen and rejected is the prompt, see
    `completion_conversations`)."""

    prompt: str | list[dict[str, Any]] | None
    completions: tuple[str | list[dict[str, Any]], ...]
    desirable: bool | None = None


def preference_rows(batch: dict[str, list], entry: Any) -> list[CompletionsRow | BadRow]:
    """(prompt, (chosen, rejected)) for each row of a ``preference`` batch.

    A missing or null value is a bad row; an empty completion, or chosen equal to rejected, is a
    counted drop (the pair would train nothing).

    >>> from types import SimpleNamespace as NS
    >>> e = NS(field_prompt="prompt", field_chosen="chosen", field_rejected="rejected", role_map={},
    ...        message_field_role="role", message_field_content="content", field_messages="messages")
    >>> preference_rows({"prompt": ["2+2?"], "chosen": ["4"], "rejected": ["5"]}, e)[0].completions
    ('4', '5')
    >>> preference_rows({"prompt": ["2+2?"], "chosen": ["4"], "rejected": ["4"]}, e)[0].reason
    'identical_completions'
    """
    n = len(batch[entry.field_chosen])
    prompts = batch.get(entry.field_prompt) or [None] * n
    known = known_roles(entry)
    out: list[CompletionsRow | BadRow] = []
    for prompt, chosen, rejected in zip(
        prompts, batch[entry.field_chosen], batch[entry.field_rejected], strict=True
    ):
        values = [
            _prompt(prompt, entry, known, batch),
            _turns(chosen, entry.field_chosen, entry, known),
            _turns(rejected, entry.field_rejected, entry, known),
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


def kto_rows(batch: dict[str, list], entry: Any) -> list[CompletionsRow | BadRow]:
    """(prompt, (completion,), desirable) for each row of a ``kto`` batch; the label must be a boolean
    (or 0/1).

    >>> from types import SimpleNamespace as NS
    >>> e = NS(field_prompt="prompt", field_completion="completion", field_label="label", role_map={},
    ...        message_field_role="role", message_field_content="content", field_messages="messages")
    >>> kto_rows({"prompt": ["2+2?"], "completion": ["4"], "label": [True]}, e)[0].desirable
    True
    >>> kto_rows({"prompt": ["2+2?"], "completion": ["4"], "label": ["yes"]}, e)[0].reason
    'not_a_boolean'
    """
    n = len(batch[entry.field_completion])
    prompts = batch.get(entry.field_prompt) or [None] * n
    known = known_roles(entry)
    out: list[CompletionsRow | BadRow] = []
    for prompt, completion, label in zip(
        prompts, batch[entry.field_completion], batch[entry.field_label], strict=True
    ):
        values = [
            _prompt(prompt, entry, known, batch),
            _turns(completion, entry.field_completion, entry, known),
            _boolean(label, entry.field_label),
        ]
        bad = next((v for v in values if isinstance(v, BadRow)), None)
        out.append(bad if bad is not None else CompletionsRow(values[0], (values[1],), values[2]))
    return out


def _turns(
    value: Any, field: str, entry: Any, known: set[str], *, optional: bool = False, completion: bool = True
) -> str | list[dict[str, Any]] | BadRow | None:
    """A prompt or completion: a string, or a list of messages normalized like a chat row's. An
    ``optional`` one (a prompt column the data does not have) may be None."""
    if value is None and optional:
        return None
    if isinstance(value, list):
        return conversation(value, entry, known, field=field)
    text = _text(value, field)
    if isinstance(text, str) and completion and not text.strip():
        return BadRow(field, EMPTY_COMPLETION, _empty_detail(field, text), malformed=False)
    return text


def _prompt(value: Any, entry: Any, known: set[str], batch: dict[str, list]) -> Any:
    optional = entry.field_prompt not in batch  # no prompt column: None, the completions hold it
    return _turns(value, entry.field_prompt, entry, known, optional=optional, completion=False)


def _boolean(value: Any, field: str) -> bool | BadRow:
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    if value is None:
        return BadRow(field, MISSING_FIELD, f"{field!r} is missing or null")
    return BadRow(
        field, NOT_A_BOOLEAN, f"{field!r} should be true (desirable) or false (undesirable), got {value!r}"
    )


def is_conversational(row: CompletionsRow) -> bool:
    """Whether any part of the row is a list of messages (then it is rendered with the chat template).

    >>> is_conversational(CompletionsRow("Hi", ("Hello", "Go away"))), is_conversational(CompletionsRow(None, ([],)))
    (False, True)
    """
    return isinstance(row.prompt, list) or any(isinstance(c, list) for c in row.completions)


def completion_conversations(
    row: CompletionsRow, field: str
) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]] | BadRow:
    """(shared messages, each completion's messages) to render with a chat template.

    A string prompt is a user turn, a string completion an assistant turn. A completion that already
    starts with the prompt's messages (chosen and rejected holding whole conversations, as in
    UltraFeedback) does not repeat them. Then the messages chosen and rejected share at the start
    join the prompt, as TRL's implicit prompt; a kto completion without a prompt is its last
    message, the rest its prompt. A completion left with no message is a counted drop.

    >>> row = CompletionsRow("2+2?", ([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    ...                              "5"))
    >>> shared, (chosen, rejected) = completion_conversations(row, "chosen")
    >>> [m["content"] for m in shared], [m["content"] for m in chosen], [m["content"] for m in rejected]
    (['2+2?'], ['4'], ['5'])
    """
    prompt = [] if row.prompt is None else _as_messages(row.prompt, "user")
    completions = []
    for value in row.completions:
        messages = _as_messages(value, "assistant")
        if prompt and messages[: len(prompt)] == prompt:
            messages = messages[len(prompt) :]
        completions.append(messages)
    if len(completions) > 1:
        common = _common_start(completions)
        prompt, completions = prompt + completions[0][:common], [c[common:] for c in completions]
    elif row.prompt is None and len(completions[0]) > 1:
        prompt, completions = completions[0][:-1], [completions[0][-1:]]
    if not all(completions):
        detail = f"{field!r} holds no message after the prompt: nothing to score"
        return BadRow(field, EMPTY_COMPLETION, detail, malformed=False)
    return prompt, completions


def shared_text_prefix(texts: Sequence[str]) -> str:
    """The longest common start of ``texts``, cut after its last whitespace so no word is split (the
    implicit prompt of string pairs without a prompt column, as TRL's ``extract_prompt``).

    >>> shared_text_prefix(["Human: hi Assistant: hello", "Human: hi Assistant: go away"])
    'Human: hi Assistant: '
    """
    first, *rest = texts
    n = min(len(t) for t in texts)
    end = next((i for i in range(n) if any(t[i] != first[i] for t in rest)), n)
    cut = max(first.rfind(" ", 0, end), first.rfind("\n", 0, end))
    return first[: cut + 1] if cut >= 0 else ""


def _as_messages(value: str | list[dict[str, Any]], role: str) -> list[dict[str, Any]]:
    return [{"role": role, "content": value}] if isinstance(value, str) else list(value)


def _common_start(lists: list[list]) -> int:
    n = min(len(x) for x in lists)
    return next((i for i in range(n) if any(x[i] != lists[0][i] for x in lists[1:])), n)
