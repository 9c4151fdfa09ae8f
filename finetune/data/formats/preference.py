"""``preference``: a prompt and two completions, the chosen one preferred to the rejected one.

A row ``{"prompt": "2+2?", "chosen": "4", "rejected": "5"}`` is one example: ``[bos] 2+2? 4 eos``
then ``[bos] 2+2? 5 eos`` in ``input_ids`` / ``labels`` (prompts masked), ``chosen_len`` saying where
the rejected sequence starts. Each value may be a list of messages instead (then the row is rendered
with the chat template, as every row is with ``apply_chat_template``); without a prompt column the
shared start of chosen and rejected is the prompt (`completion_conversations`). The length limit
applies to the pair, the unit that is packed and never split (finetune.data.batching.pairs).

For a vision-language model (model.kind vlm) the prompt may hold images: image parts in its messages,
or an ``images`` column (``field_images``) with one ``<image>`` placeholder per image in its text.
Chosen and rejected share them: both sequences get the images' tokens (`pair_images`).

With ``field_margin`` (train.objective reward) each pair also carries its ``margin``, a number read from
that column (TRL's margin column).

>>> from types import SimpleNamespace as NS
>>> e = NS(field_prompt="prompt", field_chosen="chosen", field_rejected="rejected", role_map={},
...        message_field_role="role", message_field_content="content")
>>> rows({"prompt": ["2+2?"], "chosen": ["4"], "rejected": ["5"]}, e)[0].completions
('4', '5')
>>> rows({"prompt": ["2+2?"], "chosen": ["4"], "rejected": ["4"]}, e)[0].reason
'identical_completions'

What the preference and kto formats share (the kto format uses this module's rows and paths): rows of a
prompt and the completions scored given it.

A preference pair holds two completions (chosen, then rejected), a kto example one, labelled
desirable or not. The prompt and each completion are a string or a list of messages. Strings
tokenize as ``[bos] prompt completion eos`` (the prompt tokenized once for both completions);
message lists, and every row with apply_chat_template, are rendered with the chat template and
train only the completion's turns. The shared conversation prefix must give the same tokens before
both completions of a pair, else the row is bad (``prefix_mismatch``,
`shared_prefix_problem`).

>>> row = CompletionsRow("2+2?", ("4", "5"))
>>> is_conversational(row), shared_text_prefix(["Q: 2+2? A: 4", "Q: 2+2? A: 5"])
(False, 'Q: 2+2? A: ')
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import datasets

from finetune.constants import IGNORE_INDEX
from finetune.data.formats import images
from finetune.data.formats.chat import (
    ChatTemplateError,
    MessageKeys,
    chat_spans,
    conversation,
    known_roles,
    message_keys,
)
from finetune.data.formats.chat_template import with_row_images
from finetune.data.formats.encode import Encoder, expand, load_images
from finetune.data.formats.rows import (
    EMPTY_COMPLETION,
    IDENTICAL_COMPLETIONS,
    MISSING_FIELD,
    PREFIX_MISMATCH,
    WRONG_TYPE,
    BadRow,
    Example,
    empty_detail,
    optional_column,
    text,
)

FEATURES = {"chosen_len": datasets.Value("int32")}
"""Per-example column besides input_ids and labels: the length of the chosen sequence."""

IMAGE_IN_COMPLETION = "image_in_completion"
"""Bad-row reason: a preference pair's chosen or rejected messages hold an image (only prompts may)."""


# -------------------------------------------------------------------------------------------- the format


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
    out = parsed_rows(batch, entry, (entry.field_chosen, entry.field_rejected))
    for k, row in enumerate(out):
        if not isinstance(row, BadRow) and row.completions[0] == row.completions[1]:
            detail = f"{entry.field_chosen!r} and {entry.field_rejected!r} are the same: the pair would train nothing"
            out[k] = BadRow(entry.field_rejected, IDENTICAL_COMPLETIONS, detail, malformed=False)
    return out


def renders_chat(entry: Any, features: datasets.Features) -> bool:
    """With ``apply_chat_template``, or when a column read holds lists of messages."""
    return chat_rendered(entry, features, columns)


def tokenize(batch: dict[str, list], entry: Any, enc: Encoder) -> list[Example | BadRow]:
    """Each pair as one example, chosen then rejected (`completion_examples`); with a
    vision-language processor, the images column (when the data has it) placed in the prompts."""
    parsed = with_images(rows(batch, entry), batch, entry, enc)
    examples = completion_examples(
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


# --------------------------------------------------------------- a prompt and its completions (and kto's)


@dataclass(frozen=True)
class CompletionsRow:
    """A prompt and the completions scored given it: (chosen, rejected) for a preference pair, one for
    kto (``desirable`` says whether it is). Each is a string or a list of messages; ``prompt`` is None
    when the row has none (preference: the shared start of chosen and rejected is the prompt, see
    `completion_conversations`)."""

    prompt: str | list[dict[str, Any]] | None
    completions: tuple[str | list[dict[str, Any]], ...]
    desirable: bool | None = None


def turns(
    value: Any,
    field: str,
    keys: MessageKeys,
    known: set[str],
    *,
    optional: bool = False,
    completion: bool = True,
) -> str | list[dict[str, Any]] | BadRow | None:
    """A prompt or completion: a string, or a list of messages normalized like a chat row's. An
    ``optional`` one (a prompt column the data does not have) may be None; an empty completion is a
    counted drop."""
    if value is None and optional:
        return None
    if isinstance(value, list):
        return conversation(value, field, keys, known)
    value = text(value, field)
    if isinstance(value, str) and completion and not value.strip():
        return BadRow(field, EMPTY_COMPLETION, empty_detail(field, value), malformed=False)
    return value


def prompts(batch: dict[str, list], field: str, keys: MessageKeys, known: set[str]) -> list[Any]:
    """The prompt of each row: None for all when the data has no prompt column (the completions hold it)."""
    if field not in batch:
        return [None] * len(next(iter(batch.values())))
    return [turns(value, field, keys, known, completion=False) for value in batch[field]]


def parsed_rows(batch: dict[str, list], entry: Any, fields: Sequence[str]) -> list[CompletionsRow | BadRow]:
    """Each row's prompt (`prompts`, from the entry's `field_prompt`) and its completions in the columns
    `fields` (`turns`), or the first of their problems: a row of the preference and kto formats,
    before the checks each makes of its own."""
    keys = message_keys(entry)
    known = known_roles(keys.role_map)
    out: list[CompletionsRow | BadRow] = []
    for k, prompt in enumerate(prompts(batch, entry.field_prompt, keys, known)):
        values = [prompt, *(turns(batch[field][k], field, keys, known) for field in fields)]
        bad = next((v for v in values if isinstance(v, BadRow)), None)
        out.append(bad if bad is not None else CompletionsRow(values[0], tuple(values[1:])))
    return out


def is_conversational(row: CompletionsRow) -> bool:
    """Whether any part of the row is a list of messages (then it is rendered with the chat template).

    >>> is_conversational(CompletionsRow("Hi", ("Hello", "Go away"))), is_conversational(CompletionsRow(None, ([],)))
    (False, True)
    """
    return isinstance(row.prompt, list) or any(isinstance(c, list) for c in row.completions)


def chat_rendered(
    entry: Any, features: datasets.Features, columns: Callable[[Any, Sequence[str]], dict[str, str]]
) -> bool:
    """Whether a preference or kto entry's rows are rendered with the chat template: with its
    ``apply_chat_template``, or when a column it reads (`columns`, its format's) holds lists (of messages)."""
    if entry.apply_chat_template:
        return True
    read = columns(entry, list(features)).values()
    return any(isinstance(features.get(c), (datasets.List, datasets.LargeList)) for c in read)


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


def shared_prefix_problem(
    texts: Sequence[str], spans: Sequence[list[tuple[int, int]]], encodings
) -> str | None:
    """Why chosen and rejected do not share their conversation prefix token for token, or None.

    `texts` are the rendered chosen and rejected conversations, `spans` their trained character
    spans (the completion's first span starts where the completion does), `encodings` their fast
    tokenizer encodings (ids and offsets). The text before each completion must be the same, and so
    must its tokens, up to its trailing whitespace (which may merge with a completion's first word,
    as Llama's `▁It`): a template that renders the shared turns differently depending on the
    completion would make the two sequences differ in more than their completions.
    """
    if len(texts) < 2:
        return None
    starts = [s[0][0] if s else len(t) for t, s in zip(texts, spans, strict=True)]
    prefixes = [t[:start] for t, start in zip(texts, starts, strict=True)]
    if any(p != prefixes[0] for p in prefixes[1:]):
        at = next(
            (i for i, chars in enumerate(zip(*prefixes, strict=False)) if len(set(chars)) > 1),
            min(map(len, prefixes)),
        )
        return (
            f"the chat template renders the shared conversation differently before chosen and before rejected "
            f"(first difference at character {at}: {prefixes[0][at : at + 30]!r} vs {prefixes[1][at : at + 30]!r}); "
            "use a template that renders earlier turns independently of the last one"
        )
    stable = len(prefixes[0].rstrip())
    heads = [e.ids[: _tokens_ending_by(e.offsets, stable)] for e in encodings]
    if any(h != heads[0] for h in heads[1:]):
        return (
            "the shared conversation tokenizes differently before chosen and before rejected (a token merges "
            "the prompt's end with the completion); the pair would not compare completions of one prompt"
        )
    return None


def _tokens_ending_by(offsets: Sequence[tuple[int, int]], end: int) -> int:
    """How many leading tokens lie entirely within the first `end` characters."""
    return next((i for i, (_, stop) in enumerate(offsets) if stop > end), len(offsets))


def _as_messages(value: str | list[dict[str, Any]], role: str) -> list[dict[str, Any]]:
    return [{"role": role, "content": value}] if isinstance(value, str) else list(value)


def _common_start(lists: list[list]) -> int:
    n = min(len(x) for x in lists)
    return next((i for i in range(n) if any(x[i] != lists[0][i] for x in lists[1:])), n)


def pair_images(
    shared: list[dict[str, Any]], completions: list[list[dict[str, Any]]], enc: Encoder, field: str
) -> list[bytes] | BadRow:
    """The images of a preference pair's (or kto example's) shared prompt, opened and checked: both
    completions are scored given them. An image inside a completion is a bad row (the pair would compare
    completions that see different pictures), and so is any image when the model reads only text."""
    if not any(m.get("images") for c in (shared, *completions) for m in c):
        return []
    if enc.processor is None:
        detail = (
            "the row has images, but the model reads only text; for a vision-language model set model.kind: "
            "vlm (its processor then reads the images), or remove the image parts"
        )
        return BadRow(field, images.IMAGES_NEED_VLM, detail)
    if any(m.get("images") for c in completions for m in c):
        detail = (
            "an image is in a completion, not in the prompt: completions (a pair's chosen and rejected, a kto "
            "example's completion) are scored given the prompt and its images, so put the images in the prompt's "
            "messages"
        )
        return BadRow(field, IMAGE_IN_COMPLETION, detail)
    return load_images(shared, enc, field)


# ------------------------------------------------------------------------------------------ tokenize


def completion_examples(
    rows: list[CompletionsRow | BadRow], enc: Encoder, entry: Any, *, field: str, mismatch_field: str
) -> list[Example | BadRow]:
    """One example per row: a preference pair is its chosen sequence then its rejected one (with
    ``chosen_len``), a kto example one sequence (with ``desirable`` and ``prompt_len``). Strings go
    as ``[bos] prompt completion eos``; message lists (or every row, with the entry's
    `apply_chat_template`) are rendered with the chat template, its `roles_to_train` and `train_on_eos`
    applied. `field` names the column of a chat row's problems, `mismatch_field` that of a pair whose
    shared prefix tokenizes differently."""
    chat = [not isinstance(r, BadRow) and (entry.apply_chat_template or is_conversational(r)) for r in rows]
    paths: list[tuple[bool, Callable[[list[CompletionsRow]], list[Any]]]] = [
        (False, lambda picked: _plain_examples(picked, enc, train_eos=entry.train_on_eos != "none")),
        (
            True,
            lambda picked: _chat_examples(
                picked,
                enc,
                field=field,
                mismatch_field=mismatch_field,
                roles_to_train=entry.roles_to_train,
                train_on_eos=entry.train_on_eos,
                image_field=entry.field_prompt,
            ),
        ),
    ]
    out: list[Any] = list(rows)
    for is_chat, done in paths:
        picked = [k for k, r in enumerate(rows) if not isinstance(r, BadRow) and chat[k] == is_chat]
        for k, row in zip(picked, done([rows[k] for k in picked]) if picked else [], strict=True):
            out[k] = row
    return out


def _plain_examples(rows: list[CompletionsRow], enc: Encoder, *, train_eos: bool) -> list[Example]:
    prompts = [
        r.prompt
        if r.prompt is not None
        else shared_text_prefix(r.completions)
        if len(r.completions) > 1
        else ""
        for r in rows
    ]
    texts = [
        c[len(p) :] if r.prompt is None else c
        for r, p in zip(rows, prompts, strict=True)
        for c in r.completions
    ]
    prompt_ids, completion_ids = enc.ids(prompts), iter(enc.ids(texts))
    prefix, eos = enc.prefix_ids, enc.eos_id
    end = eos if train_eos else IGNORE_INDEX
    out = []
    for row, p_ids in zip(rows, prompt_ids, strict=True):
        head = [*prefix, *p_ids]
        sequences = []
        for _ in row.completions:
            c_ids = next(completion_ids)
            sequences.append(([*head, *c_ids, eos], [IGNORE_INDEX] * len(head) + [*c_ids, end]))
        out.append(_example(row, sequences, prompt_len=len(head)))
    return out


def _chat_examples(
    rows: list[CompletionsRow],
    enc: Encoder,
    *,
    field: str,
    mismatch_field: str,
    roles_to_train: list[str],
    train_on_eos: str,
    image_field: str,
) -> list[Example | BadRow]:
    out: list[Any] = [None] * len(rows)
    pending = []  # (row index, [(text, spans) per completion], the shared prompt's images)
    for k, row in enumerate(rows):
        convs = completion_conversations(row, field)
        if isinstance(convs, BadRow):
            out[k] = convs
            continue
        shared, completions = convs
        pictures = pair_images(shared, completions, enc, image_field)  # checked and loaded
        if isinstance(pictures, BadRow):
            out[k] = pictures
            continue
        try:
            seqs = [_render_completion(shared, c, enc, roles_to_train, train_on_eos) for c in completions]
            pending.append((k, seqs, pictures))
        except ChatTemplateError as e:
            out[k] = BadRow(field, e.reason, str(e))
    encodings = iter(enc.encode([text for _, seqs, _ in pending for text, _ in seqs], offsets=True))
    for k, seqs, pictures in pending:
        encs = [next(encodings) for _ in seqs]
        mismatch = shared_prefix_problem([text for text, _ in seqs], [spans for _, spans in seqs], encs)
        if mismatch:
            out[k] = BadRow(mismatch_field, PREFIX_MISMATCH, mismatch)
            continue
        sequences = [enc.labelled(e, spans) for e, (_, spans) in zip(encs, seqs, strict=True)]
        if pictures:  # each sequence's image markup expanded into the model's image tokens
            sequences = [
                expand(enc, text, pictures, ids, labels, field=field)
                for (text, _), (ids, labels) in zip(seqs, sequences, strict=True)
            ]
            bad = next((s for s in sequences if isinstance(s, BadRow)), None)
            if bad is not None:
                out[k] = bad
                continue
        labels = sequences[0][1]
        prompt_len = next((t for t, x in enumerate(labels) if x != IGNORE_INDEX), len(labels))
        out[k] = _example(rows[k], sequences, prompt_len=prompt_len)
        if pictures:
            out[k][2]["images"] = pictures
    return out


def _render_completion(
    shared: list[dict[str, Any]],
    completion: list[dict[str, Any]],
    enc: Encoder,
    roles_to_train: list[str],
    train_on_eos: str,
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and its trained spans: the completion's turns only."""
    conv = [*shared, *completion]
    trained = [i for i in range(len(shared), len(conv)) if conv[i]["role"] in roles_to_train]
    return chat_spans(
        conv, enc.render, roles_to_train=roles_to_train, train_on_eos=train_on_eos, trained=trained
    )


def _example(
    row: CompletionsRow, sequences: list[tuple[list[int], list[int]]], *, prompt_len: int
) -> tuple[list[int], list[int], dict[str, Any]]:
    """One example of a preference pair (chosen then rejected, concatenated) or a kto example."""
    if len(sequences) == 1:
        (ids, labels) = sequences[0]
        return ids, labels, {"desirable": row.desirable, "prompt_len": prompt_len}
    (chosen, chosen_labels), (rejected, rejected_labels) = sequences
    return [*chosen, *rejected], [*chosen_labels, *rejected_labels], {"chosen_len": len(chosen)}
