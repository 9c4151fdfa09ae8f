"""The dataset entries of a recipe: one schema class per data format, chosen by the entry's `type`.

`DatasetEntry`, the type of an item of `data.datasets` and `data.test_datasets`, is a pydantic union
discriminated by `type`. The fields every format shares (where the data is, which part of it, its
length limit) are those of `_Entry`; each class adds the fields its format reads, so a key that
only another format reads is an error, and the message names the type(s) that read it
(finetune.recipe.errors). An entry whose `type` is missing or unknown is validated as
`_UnknownTypeEntry`: that reports the type (with the valid ones) and a missing path, and judges no
other key, since which keys are allowed depends on the type.

The data side of each LLM format is finetune/data/formats/<type>.py, found by the registry in
finetune/data/formats/registry.py; images and dreambooth entries are read by finetune/diffusion.
A new format is a class here, added to `ENTRY_CLASSES`, plus its module there.

>>> entry = dataset_entry(path="qa.jsonl", type="input_output", field_prompt="question")
>>> type(entry).__name__, entry.field_prompt, entry.field_completion
('InputOutputEntry', 'question', 'completion')
>>> CHAT_RENDERABLE_TYPES
('alpaca', 'input_output', 'preference', 'kto', 'prompt')
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, TypeAdapter, field_validator
from pydantic_core import PydanticCustomError

from finetune.recipe.base import Problem, _Section

_TYPE_DESCRIPTION = "How rows are formatted into prompt and trained text."

# Fields several formats read, with the same meaning and default.
TrainOnInputs = Annotated[
    bool, Field(False, description="Train on prompt tokens too (otherwise they get label -100).")
]

# The largest mixture weight: each row that many times (a weight of 1e6 asked for a 21 GiB index).
MAX_WEIGHT = 1000.0


def _apply_chat_template(turns: str) -> Any:
    return Field(
        False,
        description="Render each row as a chat with the model's chat template (for instruct models): "
        f"{turns}, plus whatever the template adds (e.g. its default system prompt). Only the completion and "
        "its end-of-turn token (per train_on_eos) are trained.",
    )


RolesToTrain = Annotated[
    list[str],
    Field(
        default_factory=lambda: ["assistant"],
        description="Roles whose turns are trained when rows are rendered with the chat template.",
    ),
]
TrainOnEos = Annotated[
    Literal["turn", "last", "all", "none"],
    Field(
        "turn",
        description="Which end-of-turn tokens are trained: of every trained turn (turn), only the last "
        "trained turn (last), every turn (all), none. Without a chat template the eos appended to the row "
        "is trained unless none.",
    ),
]
MessageRole = Annotated[str, Field("role", description="Key of a message's role, in lists of messages.")]
MessageContent = Annotated[
    str, Field("content", description="Key of a message's content, in lists of messages.")
]
RoleMap = Annotated[
    dict[str, str],
    Field(
        default_factory=dict,
        description="Map the data's roles to template roles, e.g. {human: user, gpt: assistant}.",
    ),
]
PromptColumn = Annotated[str, Field("prompt", description="Column with the prompt.")]
CompletionColumn = Annotated[str, Field("completion", description="Column with the completion.")]


def _entry_type(value: Any) -> str | None:
    """The union member an entry validates as: its type, or the unknown-type entry (None: not a mapping)."""
    if isinstance(value, _Entry):
        return value.type
    if not isinstance(value, dict):
        return None
    tag = value.get("type")
    return tag if isinstance(tag, str) and tag in ENTRY_TYPES else _UNKNOWN


class _Entry(_Section):
    """The fields every dataset entry has: where the data is and which part of it is used."""

    # What the rows hold, and so which objectives train on them: text (sft), preference pairs (dpo,
    # ipo, simpo, orpo), kto examples (kto), prompts (grpo), images (diffusion recipes).
    kind: ClassVar[Literal["text", "preference", "kto", "prompt", "images"]] = "text"
    # Why a key that other formats read does not apply to this one, where their names alone do not
    # say it (shown with the unknown-key error, see finetune.recipe.errors).
    not_read: ClassVar[dict[str, str]] = {}

    path: str = Field(description="Local file or directory, Hub dataset id, or s3:// gs:// https:// URL.")
    type: str = Field(description=_TYPE_DESCRIPTION)
    name: str | None = Field(None, description="Hub dataset configuration name.")
    split: str = Field("train", description="Split to load.")
    revision: str | None = Field(None, description="Hub dataset revision (branch, tag or commit).")
    data_files: str | list[str] | None = Field(None, description="File(s) inside path to load.")
    ds_type: Literal["json", "csv", "parquet", "arrow", "text"] | None = Field(
        None, description="File format; inferred from the extension when null."
    )
    shards: int | None = Field(None, ge=1, description="Split the source into this many shards...")
    shards_idx: int | None = Field(None, ge=0, description="...and keep only this one (0-based).")
    max_seq_len: int | None = Field(
        None, ge=1, description="Longest sample for this entry (overrides data.sequence_len)."
    )
    trust_remote_code: bool = Field(False, description="Allow a Hub dataset's loading script to run.")
    weight: float = Field(
        1.0,
        description="How much of this dataset a training mixture draws, from its kept training rows (after "
        "drops and the validation split): 1.0 each row once, 0.25 a seeded quarter of them, 3.0 each row three "
        "times; the fractional part f of a weight k + f draws round(f * rows) distinct rows once more (half "
        "rounds up), seeded by train.seed and the entry's index (docs/data.md, Weighted mixtures). At most 1000.",
    )

    @field_validator("weight")
    @classmethod
    def _positive_weight(cls, value: float) -> float:
        if not value > 0:
            raise PydanticCustomError(
                "weight",
                "must be a number > 0 (1.0: each row once; 0.25: a seeded quarter of the rows; 3.0: each row "
                "three times); to leave a dataset out, remove its entry",
            )
        if not value <= MAX_WEIGHT:  # also NaN and inf
            raise PydanticCustomError(
                "weight",
                f"is at most {MAX_WEIGHT:g} (each row {MAX_WEIGHT:g} times; the mixture holds every drawn row, so a "
                "larger weight asks for more rows than memory or disk can hold): lower it, or weigh the other "
                "datasets down instead",
            )
        return value

    def _problems(self, ok: Callable[..., bool]) -> list[Problem]:
        if not ok("shards", "shards_idx"):
            return []
        if (self.shards is None) != (self.shards_idx is None):
            return [("shards_idx", self.shards_idx, "set shards and shards_idx together")]
        if self.shards is not None and self.shards_idx >= self.shards:
            return [
                ("shards_idx", self.shards_idx, f"must be below shards ({self.shards}): 0..{self.shards - 1}")
            ]
        return []


_NO_TURNS = {"apply_chat_template": "it renders a prompt and completions as turns"}


class CompletionEntry(_Entry):
    """Raw text, trained whole: `{"text": "The cat sat on the mat."}`."""

    not_read = _NO_TURNS

    type: Annotated[Literal["completion"], Field(description=_TYPE_DESCRIPTION)]
    field_text: str = Field("text", description="Column with the raw text.")
    train_on_eos: TrainOnEos


class AlpacaEntry(_Entry):
    """Stanford Alpaca rows: `{"instruction": "Add.", "input": "2 and 3", "output": "5"}`."""

    type: Annotated[Literal["alpaca"], Field(description=_TYPE_DESCRIPTION)]
    field_instruction: str = Field("instruction", description="Column with the instruction.")
    field_input: str = Field(
        "input", description="Column with the optional input (context); used when the data has it."
    )
    field_output: str = Field("output", description="Column with the response (what is trained).")
    train_on_inputs: TrainOnInputs
    train_on_eos: TrainOnEos
    apply_chat_template: bool = _apply_chat_template(
        "the instruction (then the input after a blank line) as a user turn, the output as an assistant turn"
    )
    roles_to_train: RolesToTrain


class InputOutputEntry(_Entry):
    """A prompt and its completion: `{"prompt": "2+2?", "completion": "4"}`."""

    type: Annotated[Literal["input_output"], Field(description=_TYPE_DESCRIPTION)]
    field_prompt: PromptColumn
    field_completion: CompletionColumn
    train_on_inputs: TrainOnInputs
    train_on_eos: TrainOnEos
    apply_chat_template: bool = _apply_chat_template(
        "the prompt as a user turn, the completion as an assistant turn (e.g. GSM8K: {type: input_output, "
        "field_prompt: question, field_completion: answer, apply_chat_template: true})"
    )
    roles_to_train: RolesToTrain


class ChatTemplateEntry(_Entry):
    """A list of messages rendered with the chat template: `{"messages": [{"role": "user", ...}, ...]}`."""

    not_read: ClassVar[dict[str, str]] = {
        "apply_chat_template": "chat rows are always rendered with the template"
    }

    type: Annotated[Literal["chat_template"], Field(description=_TYPE_DESCRIPTION)]
    field_messages: str = Field("messages", description="Column holding the list of messages.")
    field_tools: str = Field(
        "tools",
        description="Column holding a row's tool definitions (a list of function JSON schemas, or a JSON "
        "string of one), passed to the chat template as `tools`; read when the data has it or it is set. "
        "Assistant messages may carry `tool_calls` (OpenAI or Hugging Face form): they are trained with "
        "the turn; `tool` results are not (see docs/data.md, Tool calls).",
    )
    field_images: str = Field(
        "images",
        description="LLaVA style: column holding a row's images (paths relative to the data file, bytes, or "
        "datasets Image values), one per `<image>` placeholder in the messages' text, in order; read when the "
        "data has it or it is set. Messages may instead hold images as parts ({type: image, image: PATH}). "
        "Images need model.kind: vlm (see docs/data.md, Images).",
    )
    message_field_role: MessageRole
    message_field_content: MessageContent
    role_map: RoleMap
    train_on_inputs: TrainOnInputs
    roles_to_train: RolesToTrain
    train_on_eos: TrainOnEos

    def _problems(self, ok: Callable[..., bool]) -> list[Problem]:
        problems = super()._problems(ok)
        if ok("roles_to_train") and not self.roles_to_train:
            problems.append(("roles_to_train", [], "name at least one role to train, e.g. [assistant]"))
        return problems


class TokenizedEntry(_Entry):
    """Token ids already made: `{"input_ids": [1, 415, 5255], "labels": [-100, 415, 5255]}` (labels optional)."""

    not_read = _NO_TURNS

    type: Annotated[Literal["tokenized"], Field(description=_TYPE_DESCRIPTION)]


# Preference and kto entries score completions given a prompt: what they share.
_SCORED_NOT_READ = {
    "train_on_inputs": "it scores only completions, given their prompt, which is never trained"
}


def _scored_prompt(whole: str) -> Any:
    return Field(
        "prompt",
        description="Column with the prompt (a string or a list of messages); may be left out of the data "
        f"when {whole}.",
    )


def _scored_problems(entry: PreferenceEntry | KtoEntry, ok: Callable[..., bool]) -> list[Problem]:
    if ok("train_on_eos") and entry.train_on_eos == "all":
        message = (
            f"type {entry.type} scores only the completion's turns (prompt turns are not compared): use turn, "
            "last or none"
        )
        return [("train_on_eos", "all", message)]
    return []


class _ScoredEntry(_Entry):
    """The fields of the entries whose completions a preference loss scores (preference, kto): how
    their messages are read and which of their turns are scored."""

    not_read = _SCORED_NOT_READ

    message_field_role: MessageRole
    message_field_content: MessageContent
    role_map: RoleMap
    roles_to_train: RolesToTrain
    train_on_eos: TrainOnEos

    def _problems(self, ok: Callable[..., bool]) -> list[Problem]:
        return super()._problems(ok) + _scored_problems(self, ok)


class PreferenceEntry(_ScoredEntry):
    """A preference pair: `{"prompt": "2+2?", "chosen": "4", "rejected": "5"}` (strings or lists of messages)."""

    kind = "preference"

    type: Annotated[Literal["preference"], Field(description=_TYPE_DESCRIPTION)]
    field_prompt: str = _scored_prompt("chosen and rejected are whole conversations")
    field_chosen: str = Field(
        "chosen", description="Column with the preferred completion (a string or a list of messages)."
    )
    field_rejected: str = Field(
        "rejected", description="Column with the dispreferred completion (a string or a list of messages)."
    )
    apply_chat_template: bool = _apply_chat_template(
        "a string prompt as a user turn, chosen and rejected each as an assistant turn (rows whose fields are "
        "lists of messages are always rendered with the template)"
    )
    field_images: str = Field(
        "images",
        description="LLaVA style: column holding a pair's images (paths relative to the data file, bytes, or "
        "datasets Image values), one per `<image>` placeholder in the prompt's text, in order; chosen and "
        "rejected both see them. Read when the data has it or it is set; the prompt's messages may instead "
        "hold images as parts ({type: image, image: PATH}). Images need model.kind: vlm (see docs/objectives.md, "
        "Preference pairs with images).",
    )
    field_margin: str | None = Field(
        None,
        description="train.objective reward: column holding each pair's margin, a number by which the chosen "
        "reward should exceed the rejected one (the loss is -log sigmoid(r_chosen - r_rejected - margin), TRL's "
        "margin column). Set it on every preference entry or on none.",
    )


class KtoEntry(_ScoredEntry):
    """A completion labelled desirable or not: `{"prompt": "2+2?", "completion": "4", "label": true}`."""

    kind = "kto"

    type: Annotated[Literal["kto"], Field(description=_TYPE_DESCRIPTION)]
    field_prompt: str = _scored_prompt("the completion is a whole conversation")
    field_completion: str = Field(
        "completion", description="Column with the completion (a string or a list of messages)."
    )
    field_label: str = Field("label", description="Boolean column, true when the completion is desirable.")
    apply_chat_template: bool = _apply_chat_template(
        "a string prompt as a user turn, the completion as an assistant turn (rows whose fields are lists of "
        "messages are always rendered with the template)"
    )
    field_images: str = Field(
        "images",
        description="LLaVA style: column holding an example's images (paths relative to the data file, bytes, "
        "or datasets Image values), one per `<image>` placeholder in the prompt's text, in order. Read when the "
        "data has it or it is set; the prompt's messages may instead hold images as parts ({type: image, "
        "image: PATH}). Images need model.kind: vlm (see docs/objectives.md, KTO with images).",
    )


class PromptEntry(_Entry):
    """A prompt alone, for online RL: `{"question": "2+2?", "answer": "4"}` with field_prompt question; the
    other columns stay available to the rewards (grpo.rewards[].field_expected)."""

    kind = "prompt"
    not_read: ClassVar[dict[str, str]] = {
        "train_on_inputs": "the prompt is never trained: the model's sampled completions are",
        "train_on_eos": "the prompt is never trained: the model's sampled completions are",
    }

    type: Annotated[Literal["prompt"], Field(description=_TYPE_DESCRIPTION)]
    field_prompt: str = Field(
        "prompt",
        description="Column with the prompt (a string, or a list of messages rendered by the template).",
    )
    apply_chat_template: bool = Field(
        False,
        description="Render a string prompt as a user turn with the model's chat template, ending with its "
        "generation prompt (for instruct models); a prompt that is a list of messages always is.",
    )
    field_images: str = Field(
        "images",
        description="LLaVA style: column holding a prompt's images (paths relative to the data file, bytes, or "
        "datasets Image values), one per `<image>` placeholder in the prompt's text, in order; completions are "
        "sampled and scored given them. Read when the data has it or it is set; the prompt's messages may instead "
        "hold images as parts ({type: image, image: PATH}). Images need model.kind: vlm (see docs/data.md, "
        "Prompts with images).",
    )


class ImagesEntry(_Entry):
    """Images with captions (model.kind: diffusion): a folder with metadata.jsonl / metadata.csv or .txt
    sidecars, or a Hub image dataset (columns named in the diffusion section)."""

    kind = "images"

    type: Annotated[Literal["images"], Field(description=_TYPE_DESCRIPTION)]


class DreamboothEntry(_Entry):
    """A DreamBooth instance folder (model.kind: diffusion): every image gets diffusion.instance_prompt."""

    kind = "images"

    type: Annotated[Literal["dreambooth"], Field(description=_TYPE_DESCRIPTION)]


ENTRY_CLASSES: tuple[type[_Entry], ...] = (
    CompletionEntry,
    AlpacaEntry,
    InputOutputEntry,
    ChatTemplateEntry,
    TokenizedEntry,
    PreferenceEntry,
    KtoEntry,
    PromptEntry,
    ImagesEntry,
    DreamboothEntry,
)
ENTRY_TYPES: dict[str, type[_Entry]] = {
    typing.get_args(cls.model_fields["type"].annotation)[0]: cls for cls in ENTRY_CLASSES
}
DatasetType = Literal[tuple(ENTRY_TYPES)]

# Entry types of diffusion recipes (model.kind: diffusion).
IMAGE_DATASET_TYPES = tuple(name for name, cls in ENTRY_TYPES.items() if cls.kind == "images")
# Entry types of preference objectives (train.objective): pairs (prompt, chosen, rejected) for dpo,
# ipo, simpo and orpo; single completions labelled desirable or not for kto.
PREFERENCE_DATASET_TYPES = tuple(
    name for name, cls in ENTRY_TYPES.items() if cls.kind in ("preference", "kto")
)
# Entry types whose prompt and completions may be rendered as a user and an assistant turn.
CHAT_RENDERABLE_TYPES = tuple(
    name for name, cls in ENTRY_TYPES.items() if "apply_chat_template" in cls.model_fields
)

_UNKNOWN = "?"  # the union tag of entries without a valid type (never a type name: see _entry_type)


class _UnknownTypeEntry(_Entry):
    """An entry whose type is missing or not a known one: always invalid (see the module docstring)."""

    # Without a type there is no telling which keys are allowed: the others are not judged.
    model_config = ConfigDict(extra="ignore")

    type: Annotated[DatasetType, Field(description=_TYPE_DESCRIPTION)]


DatasetEntry = Annotated[
    Union[  # built from ENTRY_TYPES, so the members are listed once
        (
            *(Annotated[cls, Tag(name)] for name, cls in ENTRY_TYPES.items()),
            Annotated[_UnknownTypeEntry, Tag(_UNKNOWN)],
        )
    ],
    Discriminator(
        _entry_type,
        custom_error_type="entry_type",
        custom_error_message="Input should be a mapping (a dataset entry: path, type and that type's fields)",
    ),
]
"""One item of data.datasets / data.test_datasets: the class of its `type`."""


@functools.cache
def _adapter() -> TypeAdapter:
    return TypeAdapter(DatasetEntry)


def dataset_entry(**fields: Any) -> _Entry:
    """The entry of `fields`, validated as the class of its type (pydantic's ValidationError if invalid).

    >>> dataset_entry(path="a.jsonl", type="alpaca").field_output
    'output'
    """
    return _adapter().validate_python(fields)
